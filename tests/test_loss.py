"""grpo_loss, advantages, masks and log-probs against independent references; how a batch is cut into
micro-batches."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from batches import collate, normaliser, pad_batch
from grpo_train import advantages, completion_logps, grpo_loss
from rewards import overlong_penalty

AGGS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]


def reference_loss(logps, old, ref, adv, lens, beta, eps_low, eps_high, agg, max_len):
    """The formulas of the issue, token by token in plain Python floats (float64)."""
    per_seq = []
    for i, n in enumerate(lens):
        toks = []
        for t in range(n):
            r = math.exp(logps[i][t] - old[i][t])
            surr = min(r * adv[i], min(max(r, 1 - eps_low), 1 + eps_high) * adv[i])
            kl = 0.0
            if beta > 0:
                d = ref[i][t] - logps[i][t]
                kl = math.exp(d) - d - 1
            toks.append(-(surr - beta * kl))
        per_seq.append(toks)
    return aggregate(per_seq, agg, max_len)


def aggregate(per_seq, agg, max_len):
    """Token losses, one list per sequence -> the batch's loss under --agg."""
    all_tokens = [x for s in per_seq for x in s]
    if agg == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in per_seq) / len(per_seq)
    if agg == "token-mean":
        return sum(all_tokens) / len(all_tokens)
    return sum(all_tokens) / (len(per_seq) * max_len)


def gspo_reference_loss(logps, old, ref, adv, lens, beta, eps_low, eps_high, agg, max_len):
    """GSPO (Zheng et al., 2025, eq. 5-7) in plain Python floats: s_i = (pi(y_i) / pi_old(y_i)) ^ (1 / |y_i|), the
    sequences' probabilities as products over their tokens; min(s_i A_i, clip(s_i) A_i) is every token's
    surrogate; the k3 KL stays per token; --agg weighs the tokens as for GRPO."""
    per_seq = []
    for i, n in enumerate(lens):
        p_new = math.prod(math.exp(x) for x in logps[i][:n])
        p_old = math.prod(math.exp(x) for x in old[i][:n])
        s = (p_new / p_old) ** (1 / n)
        surr = min(s * adv[i], min(max(s, 1 - eps_low), 1 + eps_high) * adv[i])
        kls = [math.exp(ref[i][t] - logps[i][t]) - (ref[i][t] - logps[i][t]) - 1 if beta else 0.0
               for t in range(n)]
        per_seq.append([-(surr - beta * kl) for kl in kls])
    return aggregate(per_seq, agg, max_len)


def random_batch(B=5, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g).tolist()
    lens[0] = T
    mask = (torch.arange(T)[None] < torch.tensor(lens)[:, None]).long()
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3   # ratios well outside the clip
    ref = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logps, old, ref, adv, mask, lens


def assert_gradient_matches(grad, logps, lens, mask, reference, h=1e-6):
    """grad equals the central differences of the float64 reference loss, token by token; padding gets none."""
    for i, n in enumerate(lens):
        for t in range(n):
            up, down = logps.tolist(), logps.tolist()
            up[i][t] += h
            down[i][t] -= h
            num = (reference(up) - reference(down)) / (2 * h)
            assert grad[i, t].item() == pytest.approx(num, rel=1e-5, abs=1e-8)
    assert (grad[mask == 0] == 0).all()


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_loss_value_and_gradient_match_float64_reference(agg, beta):
    logps, old, ref, adv, mask, lens = random_batch()
    kw = dict(beta=beta, eps_low=0.2, eps_high=0.28, agg=agg, max_len=10)
    x = logps.clone().requires_grad_(True)
    loss, _, _ = grpo_loss(x, old, ref if beta else None, adv, mask, **kw)
    loss.backward()
    expected = reference_loss(logps.tolist(), old.tolist(), ref.tolist(), adv.tolist(), lens, **kw)
    assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert_gradient_matches(x.grad, logps, lens, mask,
                            lambda lp: reference_loss(lp, old.tolist(), ref.tolist(), adv.tolist(), lens, **kw))


@pytest.mark.parametrize("agg", AGGS)
def test_gspo_sequence_ratio_matches_the_papers_formula(agg):
    """ratio_level="sequence": loss and gradient equal the paper's formula in float64, for every --agg, with
    padding of any value; clip/low and clip/high count the tokens of the sequences clipped."""
    logps, old, ref, adv, mask, lens = random_batch(B=8, T=7, seed=3)
    logps, old = logps.masked_fill(mask == 0, 50.0), old.masked_fill(mask == 0, -1e4)   # padding: anything
    kw = dict(beta=0.1, eps_low=0.03, eps_high=0.04, agg=agg, max_len=10)
    x = logps.clone().requires_grad_(True)
    loss, _, stats = grpo_loss(x, old, ref, adv, mask, ratio_level="sequence", **kw)
    loss.backward()
    ref_loss = lambda lp: gspo_reference_loss(lp, old.tolist(), ref.tolist(), adv.tolist(), lens, **kw)
    assert loss.item() == pytest.approx(ref_loss(logps.tolist()), rel=1e-10, abs=1e-12)
    assert_gradient_matches(x.grad, logps, lens, mask, ref_loss)
    s = [math.exp(sum(logps[i, :n] - old[i, :n]).item() / n) for i, n in enumerate(lens)]
    low = sum(n for si, a, n in zip(s, adv.tolist(), lens) if si < 0.97 and a < 0)
    high = sum(n for si, a, n in zip(s, adv.tolist(), lens) if si > 1.04 and a > 0)
    assert (stats["clip_low"].item(), stats["clip_high"].item()) == (low, high)
    # the batch has clipped and unclipped sequences both: the test sees the clip's both sides
    assert 0 < sum(1 for si in s if 0.97 <= si <= 1.04) < len(s) and low + high > 0


def test_kl_term_is_k3_and_vanishes_when_policy_equals_reference():
    logps, old, _, adv, mask, _ = random_batch()
    kw = dict(eps_low=0.2, eps_high=0.2, agg="token-mean", max_len=7)
    no_kl, _, _ = grpo_loss(logps, old, None, adv, mask, beta=0.0, **kw)
    same, _, st = grpo_loss(logps, old, logps.clone(), adv, mask, beta=0.5, **kw)
    assert same.item() == pytest.approx(no_kl.item(), abs=1e-12)
    assert st["kl_sum"].item() == 0.0
    _, _, st = grpo_loss(logps, old, logps + 1.0, adv, mask, beta=0.5, **kw)
    assert st["kl_sum"].item() == pytest.approx((math.exp(1) - 2) * mask.sum().item())


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batch_split_does_not_change_the_loss(agg):
    logps, old, ref, adv, mask, _ = random_batch(B=6, seed=1)
    kw = dict(beta=0.05, eps_low=0.2, eps_high=0.2, agg=agg, max_len=9)
    full, total, _ = grpo_loss(logps, old, ref, adv, mask, **kw)
    for split in ([2, 4], [1, 1, 1, 3], [5, 1]):
        parts, start = 0.0, 0
        for n in split:
            sl = slice(start, start + n)
            # a micro-batch is cut to its own longest completion, as collate does
            T = int(mask[sl].sum(1).max())
            loss, count, _ = grpo_loss(logps[sl, :T], old[sl, :T], ref[sl, :T], adv[sl], mask[sl, :T], **kw)
            parts += loss.item() * count / total
            start += n
        assert parts == pytest.approx(full.item(), rel=1e-10)


def test_ratio_one_gives_policy_gradient_and_clip_stops_it():
    logps = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 3)
    adv = torch.tensor([2.0], dtype=torch.float64)
    loss, _, st = grpo_loss(logps, logps.detach(), None, adv, mask, beta=0, eps_low=0.2, eps_high=0.2,
                            agg="token-mean", max_len=3)
    loss.backward()
    assert torch.allclose(logps.grad, torch.full((1, 3), -2.0 / 3, dtype=torch.float64))
    assert st["clip_low"].item() == 0 and st["clip_high"].item() == 0
    # ratio 1.5 > 1 + eps with a positive advantage: clipped, no gradient
    x = torch.full((1, 3), math.log(1.5), dtype=torch.float64, requires_grad=True)
    loss, _, st = grpo_loss(x, torch.zeros(1, 3, dtype=torch.float64), None, adv, mask, beta=0, eps_low=0.2,
                            eps_high=0.2, agg="token-mean", max_len=3)
    loss.backward()
    assert (x.grad == 0).all() and st["clip_high"].item() == 3 and st["clip_low"].item() == 0


def test_group_advantages():
    adv, signal = advantages([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5], group_size=4)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    assert adv[0].tolist() == pytest.approx(((r - 0.5) / (r.std() + 1e-4)).tolist())
    assert adv[0].sum().item() == pytest.approx(0.0, abs=1e-12)
    assert signal.tolist() == [True, False]   # equal rewards: no signal, the group is dropped
    adv, _ = advantages([0.0, 0.0, 1.0], group_size=3)
    assert adv[0, 2] > 0 > adv[0, 0]
    # six equal rewards of 0.1 (gsm8k,format:0.1: all formatted, none right) can have a std of 1.5e-17, not
    # 0 (torch's reduction of a single group rounds): such a group was kept, with advantages of 1e-13
    for reward, group_size in [(0.1, 6), (0.7, 7), (0.4, 12)]:
        assert advantages([reward] * group_size, group_size)[1].tolist() == [False]


def test_reward_scaling_by_hand():
    """--scale-rewards group | batch | none and --std-floor, on numbers worked out by hand."""
    rewards = [0.0, 2.0, 0.0, 0.2]   # groups of 2: means 1 and 0.1, unbiased stds sqrt(2) and sqrt(0.02)
    s1, s2 = math.sqrt(2), math.sqrt(0.02)
    adv, _ = advantages(rewards, group_size=2, scale="group")
    assert adv.flatten().tolist() == pytest.approx([-1 / (s1 + 1e-4), 1 / (s1 + 1e-4), -0.1 / (s2 + 1e-4),
                                                     0.1 / (s2 + 1e-4)])
    # batch: r - mean in the engine; merge_batches divides by the std of every engine's rewards
    adv, _ = advantages(rewards, group_size=2, scale="batch")
    assert adv.flatten().tolist() == pytest.approx([-1.0, 1.0, -0.1, 0.1])
    adv, _ = advantages(rewards, group_size=2, scale="none")   # Dr. GRPO: the mean is subtracted, nothing divided
    assert adv.flatten().tolist() == pytest.approx([-1.0, 1.0, -0.1, 0.1])
    adv, _ = advantages(rewards, group_size=2, scale="group", std_floor=0.5)   # second group's std 0.141 < 0.5: r - mean
    assert adv.flatten().tolist() == pytest.approx([-1 / (s1 + 1e-4), 1 / (s1 + 1e-4), -0.1, 0.1])


def test_overlong_penalty_by_hand():
    """DAPO's soft overlong punishment with max 20 tokens and a buffer of 8: 0 up to 12 tokens, then linear."""
    assert [overlong_penalty(n, 20, 8) for n in (0, 12, 13, 16, 20, 25)] == pytest.approx(
        [0.0, 0.0, -1 / 8, -0.5, -1.0, -1.0])
    assert overlong_penalty(20, 20, 0) == 0.0   # off


def variant_reference_loss(logps, old, vllm, ref, adv, lens, beta, eps_low, eps_high, agg, max_len,
                           is_mode="none", is_min=0.0, is_max=3.0, delta=None, kl_is_weight=False):
    """The variants' formulas token by token in plain Python floats (float64). Importance sampling (TRL's
    four modes, the MIS papers): w = pi_old / pi_vllm per token, or per sequence as the product over its
    tokens, truncated to [is_min, is_max] or 0 outside it; it multiplies the surrogate. DeepSeek-V3.2 Eq. 9:
    M_i = 0 when A_i < 0 and (1 / |o_i|) sum_t log(pi_vllm / pi_theta) > delta, else 1. DeepSeek-V3.2 Eq. 8:
    the k3 term times pi_theta / pi_vllm."""
    per_seq = []
    for i, n in enumerate(lens):
        seq_w = math.prod(math.exp(old[i][t] - vllm[i][t]) for t in range(n))
        mean_kl = sum(vllm[i][t] - logps[i][t] for t in range(n)) / n
        M = 0.0 if delta is not None and adv[i] < 0 and mean_kl > delta else 1.0
        toks = []
        for t in range(n):
            r = math.exp(logps[i][t] - old[i][t])
            surr = min(r * adv[i], min(max(r, 1 - eps_low), 1 + eps_high) * adv[i])
            w = 1.0
            if is_mode != "none":
                w = seq_w if is_mode.startswith("sequence") else math.exp(old[i][t] - vllm[i][t])
                if is_mode.endswith("truncate"):
                    w = min(max(w, is_min), is_max)
                elif not is_min <= w <= is_max:
                    w = 0.0
            d = ref[i][t] - logps[i][t]
            kl = math.exp(d) - d - 1
            if kl_is_weight:
                kl *= math.exp(logps[i][t] - vllm[i][t])
            toks.append(-(w * M * surr - beta * kl))
        per_seq.append(toks)
    return aggregate(per_seq, agg, max_len)


def variant_batch(seed):
    """random_batch with vLLM's log-probs: the trainer's old ones plus noise of 0.3 nats."""
    logps, old, ref, adv, mask, lens = random_batch(B=8, T=7, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    vllm = old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.3
    return logps, old, vllm, ref, adv, mask, lens


def check_against_reference(agg, seed, **variant):
    """grpo_loss with `variant` -> its stats, after asserting its value and gradient equal the float64
    reference's (padding of any value)."""
    logps, old, vllm, ref, adv, mask, lens = variant_batch(seed)
    logps, old = logps.masked_fill(mask == 0, 50.0), old.masked_fill(mask == 0, -1e4)   # padding: anything
    kw = dict(beta=0.1, eps_low=0.2, eps_high=0.28, agg=agg, max_len=10)
    x = logps.clone().requires_grad_(True)
    names = {"delta": "off_policy_mask"}
    loss, _, stats = grpo_loss(x, old, ref, adv, mask, vllm_logps=vllm, **kw,
                               **{names.get(k, k): v for k, v in variant.items()})
    loss.backward()
    ref_loss = lambda lp: variant_reference_loss(lp, old.tolist(), vllm.tolist(), ref.tolist(), adv.tolist(),
                                                 lens, **kw, **variant)
    assert loss.item() == pytest.approx(ref_loss(logps.tolist()), rel=1e-10, abs=1e-12)
    assert_gradient_matches(x.grad, logps, lens, mask, ref_loss)
    return stats, (logps, old, vllm, adv, mask, lens)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", ["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"])
def test_importance_sampling_modes_match_the_formulas(mode, agg):
    """--is-mode: value and gradient equal the float64 formulas; sampling/is_outside counts the tokens whose
    weight (their own, or their sequence's) is outside [is_min, is_max], and both sides of the bounds occur."""
    bounds = (0.8, 1.25) if mode.startswith("token") else (0.7, 1.5)
    stats, (_, old, vllm, _, mask, lens) = check_against_reference(agg, 5, is_mode=mode, is_min=bounds[0],
                                                                   is_max=bounds[1])
    d = ((old - vllm) * mask).tolist()
    w = [[math.exp(sum(d[i][:n]))] * n if mode.startswith("sequence") else [math.exp(x) for x in d[i][:n]]
         for i, n in enumerate(lens)]
    flat = [x for ws in w for x in ws]
    outside = sum(not bounds[0] <= x <= bounds[1] for x in flat)
    assert stats["is_outside"].item() == outside
    assert min(flat) < bounds[0] and max(flat) > bounds[1] and 0 < outside < len(flat)


def test_tis_cap_is_token_truncate_with_a_max_by_hand():
    """The former --tis-cap C is --is-mode token-truncate --is-max C: the surrogate of token t is scaled by
    min(exp(old_trainer - old_vllm), C). Hand case: ratio 1 (logps == old), A = 1, IS log-ratios 0, log 1.5,
    log 4; sequence-mask at 3 drops the sequence (product 6), at 10 weights every token by 6."""
    logps = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    vllm = -torch.log(torch.tensor([[1.0, 1.5, 4.0]], dtype=torch.float64))   # old_trainer (0) - vllm = log w
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3)
    kw = dict(beta=0, eps_low=0.2, eps_high=0.2, agg="token-mean", max_len=3, vllm_logps=vllm)
    loss, _, st = grpo_loss(logps, logps.detach(), None, adv, mask, is_mode="token-truncate", is_max=2.0, **kw)
    assert loss.item() == pytest.approx(-(1 + 1.5 + 2.0) / 3)   # weights 1, 1.5 and 4 capped at 2
    loss.backward()
    assert logps.grad[0].tolist() == pytest.approx([-1 / 3, -1.5 / 3, -2 / 3]) and st["is_outside"].item() == 1
    assert grpo_loss(logps, logps.detach(), None, adv, mask, **kw)[0].item() == pytest.approx(-1.0)   # none
    loss, _, st = grpo_loss(logps, logps.detach(), None, adv, mask, is_mode="sequence-mask", is_max=3.0, **kw)
    assert loss.item() == 0.0 and st["is_outside"].item() == 3
    loss, _, _ = grpo_loss(logps, logps.detach(), None, adv, mask, is_mode="sequence-mask", is_max=10.0, **kw)
    assert loss.item() == pytest.approx(-6.0)


def test_a_sequence_whose_weight_overflows_float32_is_masked_not_nan():
    """A long sequence far off vLLM's policy (0.8 nats a token over 120 tokens: exp(96) is inf in float32):
    sequence-mask made its weight inf * 0 = nan, and the whole step's loss nan. It is masked, as one past
    the bound is: the loss is the other sequence's alone."""
    logps = torch.zeros(2, 120, requires_grad=True)
    vllm = torch.zeros(2, 120)
    vllm[1] = -0.8
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 120)
    kw = dict(beta=0, eps_low=0.2, eps_high=0.2, agg="token-mean", max_len=120, vllm_logps=vllm)
    loss, _, stats = grpo_loss(logps, logps.detach(), None, adv, mask, is_mode="sequence-mask", **kw)
    assert loss.item() == pytest.approx(-120 / 240) and stats["is_outside"].item() == 120
    loss.backward()
    assert torch.isfinite(logps.grad).all() and logps.grad[1].abs().sum() == 0


@pytest.mark.parametrize("agg", AGGS)
def test_off_policy_sequence_mask_matches_deepseek_v32(agg):
    """--off-policy-mask delta (DeepSeek-V3.2 Eq. 9): value and gradient equal the formula; the sequences
    left out are those with A < 0 and a mean log(pi_vllm / pi_theta) above delta, counted in tokens, and the
    batch has such sequences, negative ones under delta and positive ones above it (kept)."""
    delta = 0.15
    stats, (logps, _, vllm, adv, mask, lens) = check_against_reference(agg, 7, delta=delta)
    mean_kl = [((vllm[i, :n] - logps[i, :n]).sum() / n).item() for i, n in enumerate(lens)]
    # no sequence within the finite differences' reach of delta: the mask is the same on both sides
    assert min(abs(k - delta) for k in mean_kl) > 1e-4
    masked = [a < 0 and k > delta for a, k in zip(adv.tolist(), mean_kl)]
    assert stats["off_policy"].item() == sum(n for m, n in zip(masked, lens) if m)
    assert any(masked) and any(a < 0 and not m for a, m in zip(adv.tolist(), masked))
    assert any(a > 0 and k > delta for a, k in zip(adv.tolist(), mean_kl))


@pytest.mark.parametrize("agg", AGGS)
def test_kl_is_weight_matches_deepseek_v32(agg):
    """--kl-is-weight (DeepSeek-V3.2 Eq. 8): the k3 term times pi_theta / pi_vllm; value and gradient equal
    the formula, together with the sequence-mask default."""
    check_against_reference(agg, 9, kl_is_weight=True)
    check_against_reference(agg, 9, kl_is_weight=True, is_mode="sequence-mask", is_min=0.0, is_max=3.0)


def test_kl_is_weight_gives_the_reverse_kl_gradient_in_expectation():
    """Sampling from pi_vllm, the expected gradient of the weighted k3 term is exactly grad KL(pi_theta ||
    pi_ref) (the ratio is not detached); the unweighted k3's is not. Over a vocabulary of 6, the expectation
    is the sum over every token y of pi_vllm(y) times grpo_loss's gradient on a one-token completion y."""
    g = torch.Generator().manual_seed(11)
    theta = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    log_ref = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    log_vllm = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    log_pi = torch.log_softmax(theta, 0)
    exact = torch.autograd.grad((log_pi.exp() * (log_pi - log_ref)).sum(), theta, retain_graph=True)[0]
    kw = dict(beta=1.0, eps_low=0.2, eps_high=0.2, agg="token-mean", max_len=1)
    for weighted in (True, False):
        expected = 0
        for y in range(6):
            x = log_pi[y].view(1, 1)
            loss, _, _ = grpo_loss(x, x.detach(), log_ref[y].view(1, 1), torch.zeros(1, dtype=torch.float64),
                                   torch.ones(1, 1), vllm_logps=log_vllm[y].view(1, 1), kl_is_weight=weighted,
                                   **kw)
            expected = expected + log_vllm[y].exp() * loss
        grad = torch.autograd.grad(expected, theta, retain_graph=True)[0]
        assert torch.allclose(grad, exact, atol=1e-12) == weighted, (weighted, grad, exact)


def test_eps_zero_passes_gradient_only_where_the_min_is_unclipped():
    """mu > 1 with eps 0: after the first update the ratio leaves 1 and every token whose move already helps
    (r > 1 with A > 0, r < 1 with A < 0) is clipped: zero gradient there; the others still get r * A."""
    x = torch.log(torch.tensor([[1.1, 0.9, 1.1, 0.9]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0], dtype=torch.float64)
    for a in (1.0, -1.0):
        x.grad = None
        loss, _, st = grpo_loss(x, torch.zeros_like(x), None, adv * a, torch.ones(1, 4), beta=0, eps_low=0.0,
                                eps_high=0.0, agg="token-mean", max_len=4)
        loss.backward()
        r = torch.tensor([1.1, 0.9, 1.1, 0.9], dtype=torch.float64)
        live = (r < 1) if a > 0 else (r > 1)   # where r * A < A: the unclipped term is the min
        assert x.grad[0].tolist() == pytest.approx((torch.where(live, -a * r / 4, 0.0)).tolist())
        assert (st["clip_high"] if a > 0 else st["clip_low"]).item() == 2


def test_masks_come_from_lengths_and_keep_eos():
    eos = 0   # the tiny tokenizer's EOS is also its pad, as in Qwen
    ids, attn, cmask = pad_batch([[5, 6], [7]], [[8, eos], [9, 10, eos]], pad_id=eos)
    assert ids.tolist() == [[5, 6, 8, eos, eos], [eos, 7, 9, 10, eos]]
    assert attn.tolist() == [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert cmask.tolist() == [[1, 1, 0], [1, 1, 1]]   # each completion's EOS is in the loss, padding is not
    b = collate([{"prompt": [5], "completion": [8, eos], "old": [-1.0, -2.0], "adv": 0.5, "truncated": False},
                 {"prompt": [7], "completion": [9], "old": [-3.0], "adv": -0.5, "truncated": True}], eos)
    assert b["old"].tolist() == [[-1.0, -2.0], [-3.0, 0.0]] and b["ref"] is None and b["adv"].tolist() == [0.5, -0.5]
    assert b["truncated"].tolist() == [False, True] and b["mask"].tolist() == [[1, 1], [1, 0]]
    masked = collate([{"prompt": [5], "completion": [8, eos], "old": [-1.0, -2.0], "adv": 0.5, "truncated": False},
                      {"prompt": [7], "completion": [9], "old": [-3.0], "adv": -0.5, "truncated": True}], eos,
                     mask_truncated=True)
    assert masked["mask"].tolist() == [[1, 1], [0, 0]]   # --mask-truncated: the cut completion is out of the loss


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logps_match_a_plain_forward(tiny_model, temperature):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    prompts = [[10, 11, 12], [13, 14, 15, 16, 17, 18], [20]]
    completions = [[30, 31, 0], [40], [50, 51, 52, 53, 54]]
    ids, attn, cmask = pad_batch(prompts, completions, 0)
    with torch.no_grad():
        got = completion_logps(model, ids, attn, cmask.shape[1], temperature, chunk=2)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1] / temperature
            want = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
            assert torch.allclose(got[i, :len(c)].double(), want, atol=1e-5)


def test_entropy_matches_a_plain_forward_and_keeps_nothing_for_the_backward(tiny_model):
    """completion_logps(entropy=True): the policy's per-token entropy at the temperature, from the chunked
    lm_head, equals -sum p log p of the full logits; it is detached (no part of the graph), and the log-probs
    and their gradient are the same as without it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    prompts, completions = [[10, 11, 12], [20]], [[30, 31, 0], [50, 51, 52, 53, 54]]
    ids, attn, cmask = pad_batch(prompts, completions, 0)
    logps, entropy = completion_logps(model, ids, attn, cmask.shape[1], 0.7, chunk=3, entropy=True)
    assert logps.requires_grad and not entropy.requires_grad and entropy.grad_fn is None
    with torch.no_grad():
        for i, (p, c) in enumerate(zip(prompts, completions)):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1].double() / 0.7
            logp = torch.log_softmax(logits, -1)
            want = -(logp.exp() * logp).sum(-1)
            assert torch.allclose(entropy[i, :len(c)].double(), want, atol=1e-5)
            assert want.min() > 0.1   # a random model: far from 0, so the comparison means something
    plain = completion_logps(model, ids, attn, cmask.shape[1], 0.7, chunk=3)
    grads = [torch.autograd.grad((x * cmask).sum(), model.lm_head.weight)[0] for x in (logps, plain)]
    assert torch.equal(logps, plain) and torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("agg", AGGS)
def test_a_padded_column_of_any_value_changes_nothing(agg, dtype):
    """Padding holds whatever the model says there; a log-prob of -120 (a confident model at a low
    temperature) used to make exp(ref - logp) overflow, and inf * 0 made the loss and gradient NaN."""
    logps, old, ref, adv, mask, _ = random_batch()
    kw = dict(beta=0.1, eps_low=0.2, eps_high=0.2, agg=agg, max_len=10)
    grads = []
    for extra in (None, -120.0):
        x, o, r, m = logps.to(dtype), old.to(dtype), ref.to(dtype), mask
        if extra is not None:   # one more column, padding in every row: logp -120, old and ref padded with 0
            col = torch.full((len(x), 1), extra, dtype=dtype)
            x, o, r = torch.cat([x, col], 1), torch.cat([o, 0 * col], 1), torch.cat([r, 0 * col], 1)
            m = torch.cat([m, torch.zeros(len(m), 1, dtype=m.dtype)], 1)
        x = x.clone().requires_grad_(True)
        loss, _, stats = grpo_loss(x, o, r, adv.to(dtype), m, vllm_logps=o, is_mode="token-truncate",
                                   is_max=2.0, off_policy_mask=0.1, kl_is_weight=True, **kw)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and torch.isfinite(stats["ratio_max"])
        grads.append((loss.item(), x.grad[:, :logps.shape[1]]))
    (loss0, grad0), (loss1, grad1) = grads
    # equal up to float rounding: a wider tensor sums in another order
    assert loss1 == pytest.approx(loss0, rel=1e-6) and torch.allclose(grad1, grad0, rtol=1e-5, atol=1e-9)


def test_the_normaliser_counts_what_was_sampled_and_the_tokens_in_the_loss():
    """Choice 2 and --agg token-mean with --mask-truncated, by hand. Kept: completions of 3 and 5 tokens,
    the 5 cut off; no-signal (dropped) ones that fill the batch: 4 tokens, and 6 cut off."""
    seqs = [{"completion": [1] * 3, "truncated": False}, {"completion": [1] * 5, "truncated": True}]
    fill = [(4, False), (6, True)]
    assert normaliser(seqs, fill, "seq-mean-token-mean", False) == 4   # --loss-norm sampled: P * G
    assert normaliser(seqs, [], "seq-mean-token-sum-norm", False) == 2   # --loss-norm kept
    assert normaliser(seqs, fill, "token-mean", False) == 3 + 5 + 4 + 6
    assert normaliser(seqs, fill, "token-mean", True) == 3 + 4   # only the tokens the mask keeps
    assert normaliser(seqs, [], "token-mean", True) == 3


def test_token_mean_with_mask_truncated_divides_by_the_tokens_in_the_loss():
    """Two micro-batches with the trainer's weighting (loss * count / normaliser) give exactly the
    token-mean over the tokens the mask keeps, as DAPO and verl compute it."""
    logps, old, ref, adv, mask, lens = random_batch(B=4, seed=3)
    truncated = torch.tensor([False, True, False, False])
    seqs = [{"completion": [0] * n, "truncated": bool(t)} for n, t in zip(lens, truncated)]
    kept = mask * ~truncated[:, None]
    kw = dict(beta=0.1, eps_low=0.2, eps_high=0.2, agg="token-mean", max_len=7)
    total = normaliser(seqs, [], "token-mean", mask_truncated=True)
    parts = sum(loss * count / total for loss, count, _ in
                (grpo_loss(logps[s], old[s], ref[s], adv[s], kept[s], **kw) for s in (slice(0, 2), slice(2, 4))))
    full, _, _ = grpo_loss(logps, old, ref, adv, kept, **kw)
    assert total == kept.sum().item() and parts.item() == pytest.approx(full.item(), rel=1e-12)


def test_a_batch_of_cut_off_completions_alone_has_loss_zero_not_nan():
    """--agg token-mean --mask-truncated with every completion cut off: no token in the loss. The trainer's
    weighting, loss * count / normaliser, was 0 x 0 / 0 = nan, which metrics.jsonl then held as its loss."""
    logps, old, ref, adv, mask, lens = random_batch(B=3, seed=4)
    seqs = [{"completion": [0] * n, "truncated": True} for n in lens]
    kept = mask * 0
    total = normaliser(seqs, [(5, True)], "token-mean", mask_truncated=True)
    loss, count, _ = grpo_loss(logps, old, ref, adv, kept, beta=0.1, eps_low=0.2, eps_high=0.2, agg="token-mean",
                               max_len=7)
    assert total == 1 and (loss * count / total).item() == 0.0


def test_ratio_max_is_over_the_tokens_in_the_loss():
    """ratio/max counted padding, and the tokens --mask-truncated leaves out, as ratio 1 (their log-ratio is
    set to 0): a batch whose ratios were all below 1 reported 1."""
    logps, old, ref, adv, mask, lens = random_batch(B=4, seed=5)
    old = logps + 0.5   # every ratio exp(-0.5)
    old[1, 2] = logps[1, 2] + 0.1   # the largest, exp(-0.1)
    kw = dict(beta=0.0, eps_low=0.2, eps_high=0.2, agg="token-mean", max_len=7)
    assert mask.sum() < mask.numel() and lens[1] > 2   # padding there, and the token inside
    _, _, stats = grpo_loss(logps, old, ref, adv, mask, **kw)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(-0.1))
    for level in ("token", "sequence"):
        _, _, stats = grpo_loss(logps, old, ref, adv, mask, ratio_level=level, **kw)
        assert stats["ratio_max"].item() < 1


def gsm8k_like_batch(rng, prompts=8, group_size=8):
    """A rollout's order (a group's completions together) with GSM8K-like lengths: prompts of 60-200
    tokens, completions log-normal around 150 tokens, at most 512."""
    return [{"prompt": [1] * p, "completion": [1] * min(512, int(rng.lognormvariate(math.log(150), 0.5))),
             "old": [], "id": (g, i)}
            for g, p in enumerate(rng.randint(60, 200) for _ in range(prompts)) for i in range(group_size)]


def padding(chunks):
    """Padded positions of these micro-batches, as pad_batch builds them."""
    masks = [pad_batch([s["prompt"] for s in c], [s["completion"] for s in c], 0)[1] for c, _ in chunks]
    return sum(m.numel() - m.sum().item() for m in masks)


@pytest.mark.parametrize("n_seqs,world,size", [(64, 1, 8), (64, 4, 8), (61, 4, 8), (64, 3, 5), (5, 4, 2),
                                               (3, 4, 8), (7, 2, 1)])
def test_micro_batches_keep_every_sequence_once_and_every_rank_runs_as_many(n_seqs, world, size):
    import random
    from batches import micro_batches
    seqs = gsm8k_like_batch(random.Random(n_seqs), prompts=n_seqs, group_size=1)
    plans = [micro_batches(seqs[rank::world], seqs, world, size) for rank in range(world)]
    trained = sorted(s["id"] for plan in plans for chunk, weight in plan if weight for s in chunk)
    assert trained == sorted(s["id"] for s in seqs)   # every sequence exactly once, on some rank
    # ZeRO-2 reduces at every backward: every rank runs the same number of micro-batches, none over size;
    # a rank with nothing left runs a weight-0 filler
    n_micro = math.ceil(math.ceil(n_seqs / world) / size)
    assert [len(plan) for plan in plans] == [n_micro] * world
    assert all(0 < len(chunk) <= size and weight in (0.0, 1.0) for plan in plans for chunk, weight in plan)
    assert all(len(chunk) == 1 for plan in plans for chunk, weight in plan if weight == 0.0)


@pytest.mark.parametrize("world", [1, 4])
def test_micro_batches_group_similar_lengths_so_less_is_padded(world):
    """Against cutting each rank's sequences in the batch's order (main before the grouping), on 20
    batches of 64 sequences, micro-batch 8."""
    import random
    from batches import micro_batches
    rng, grouped, in_order = random.Random(0), 0, 0
    for _ in range(20):
        seqs = gsm8k_like_batch(rng)
        for rank in range(world):
            mine = seqs[rank::world]
            grouped += padding(micro_batches(mine, seqs, world, 8))
            in_order += padding([(mine[i:i + 8], 1.0) for i in range(0, len(mine), 8)])
    assert grouped < 0.9 * in_order, (grouped, in_order)


def test_fp32_lm_head_on_a_bf16_model(tiny_model):
    """--fp32-lm-head on a bf16 model: the trainer's lm_head (run_setup.head_in_fp32) and the reference
    server's (load_model) multiply the bf16 hidden states and weight in fp32. Each one's log-probs equal a
    float64 product of its own bf16 tensors up to fp32 rounding, where a bf16 head's are off by bf16 rounding;
    the two agree to bf16 rounding; the gradient still reaches the bf16 weight."""
    import ref_server
    from run_setup import head_in_fp32
    prompts, completions = [[10, 11, 12], [20]], [[30, 31, 0], [50, 51, 52, 53, 54]]
    ids, attn, cmask = pad_batch(prompts, completions, 0)
    T = cmask.shape[1]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    plain = completion_logps(model, ids, attn, T).detach()
    head = model.lm_head
    head.forward = lambda h: torch.nn.functional.linear(h.double(), head.weight.double())
    exact = completion_logps(model, ids, attn, T).detach()
    head_in_fp32(head)
    logps = completion_logps(model, ids, attn, T)
    keep = cmask.bool()
    assert (logps.detach() - exact)[keep].abs().max() < 1e-5 < (plain - exact)[keep].abs().max()
    # the server pads whole sequences on the right, so its hidden states differ from the trainer's by bf16
    # rounding: its own float64 product is the reference for its head
    served = ref_server.load_model(tiny_model, "cpu", "bfloat16", fp32_lm_head=True)
    got = ref_server.compute_logps(served, prompts, completions, 1.0)
    served_plain = ref_server.compute_logps(ref_server.load_model(tiny_model, "cpu", "bfloat16"), prompts,
                                            completions, 1.0)
    served_head = served.get_output_embeddings()
    served_head.forward = lambda h: torch.nn.functional.linear(h.double(), served_head.weight.double())
    served_exact = ref_server.compute_logps(served, prompts, completions, 1.0)
    for row, c in enumerate(completions):
        assert (got[row] - served_exact[row]).abs().max() < 1e-5
        assert (got[row] - logps.detach()[row, :len(c)]).abs().max() < 2e-3
    assert max((p - e).abs().max() for p, e in zip(served_plain, served_exact)) > 1e-5
    logps[keep].sum().backward()
    assert head.weight.grad.dtype == torch.bfloat16 and head.weight.grad.abs().sum() > 0



def test_a_model_that_changes_its_logits_after_lm_head_is_refused_at_load(tmp_path, tiny_model, capsys):
    """Gemma2's soft-cap, Granite's logits_scaling, Cohere's logit_scale: the model's forward (and vLLM, which
    samples) changes lm_head's logits, where the trainer's completion_logps and the reference server's
    compute_logps apply lm_head alone. Such a model is refused before its weights load, by the trainer and by a
    reference server started alone, in one line naming the key and its value; Qwen2, Llama, Gemma3 (no cap by
    default) and Granite at scale 1 pass."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    import ref_server
    from run_setup import load_policy
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    tiny = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    for name, config, said in [("Gemma2", transformers.Gemma2Config(**tiny), "final_logit_softcapping 30.0"),
                               ("Granite", transformers.GraniteConfig(**tiny, logits_scaling=8.0), "logits_scaling 8.0"),
                               ("Cohere", transformers.CohereConfig(**tiny), "logit_scale 0.0625")]:
        # the trainer's log-probs of such a model are not the model's own: what the refusal stands for
        model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
        with torch.no_grad():
            # logits of a trained model's size (tens), where a random one's are near 0
            model.get_output_embeddings().weight.normal_(0, 10)
            own = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            assert (completion_logps(model, ids, torch.ones_like(ids), 4)[0] - own).abs().max() > 1e-3, name
        # config.json and a tokenizer, no weights: the refusal comes before any would load
        folder = str(tmp_path / name)
        config.save_pretrained(folder)
        AutoTokenizer.from_pretrained(tiny_model).save_pretrained(folder)
        line = f"--model {folder}: its config has {said}; this trainer's log-probs apply lm_head alone"
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            load_policy(folder)
        assert e.value.code == 1 and capsys.readouterr().err == f"grpo_train.py: {line}\n"
        with pytest.raises(SystemExit) as e:
            ref_server.load_model(folder)
        assert e.value.code == f"ref_server: {line}"
    # Falcon-H1's multiplier (when set); the neutral values, and the keys' absence, pass
    assert "lm_head_multiplier 2.0;" in ref_server.logit_transform(transformers.FalconH1Config(lm_head_multiplier=2.0))
    for config in (transformers.Qwen2Config(), transformers.LlamaConfig(), transformers.Gemma3TextConfig(),
                   transformers.Gemma3Config(), transformers.GraniteConfig(), transformers.FalconH1Config(),
                   AutoConfig.from_pretrained(tiny_model)):
        assert ref_server.logit_transform(config) is None, type(config).__name__
