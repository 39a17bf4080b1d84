"""ref_server's request decoder under random input (hypothesis): it only ever raises WireError, and what it
accepts is bounded by the body's own size. The live-server fuzz is in test_ref_server.py (it uses that server)."""
import json
import math

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from ref_client import encode_request
from ref_server import WireError, decode_request, read_body

V = 108  # tiny model's vocab
LIMITS = dict(vocab_size=V, max_seqs=16, max_tokens=2000)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ids = st.integers(0, V - 1)
# a JSON value of any type, big ints included (safetensors wants usize for shapes and offsets)
json_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3), max_leaves=6)


@st.composite
def valid_bodies(draw):
    prompts = draw(st.lists(st.lists(ids, min_size=1, max_size=8), min_size=1, max_size=6))
    completions = [draw(st.lists(ids, min_size=1, max_size=8)) for _ in prompts]
    return encode_request(prompts, completions, draw(st.floats(0.1, 2.0)))


def split(body):
    n = int.from_bytes(body[:8], "little")
    return json.loads(body[8:8 + n]), body[8 + n:]


def join(header, data):
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + data


INTERESTING = st.sampled_from([0, 1, 2, -1, V - 1, V, 2**31 - 1, -2**31]) | st.integers(-2**31, 2**31 - 1)


@st.composite
def mutated_bodies(draw):
    """A valid body with one mutation: truncated; bytes flipped (anywhere, in the header length, in the header
    JSON) or inserted; one int32 value overwritten (a length, a token id); one header entry dropped or one field
    of it (dtype, shape, offsets, metadata) replaced."""
    body = bytearray(draw(valid_bodies()))
    hlen = int.from_bytes(body[:8], "little")
    kind = draw(st.sampled_from(["truncate", "flip", "flip-hlen", "flip-header", "insert", "value", "field",
                                 "drop"]))
    if kind == "truncate":
        return bytes(body[:draw(st.integers(1, len(body) - 1))])
    if kind.startswith("flip"):
        lo, hi = {"flip": (0, len(body)), "flip-hlen": (0, 8), "flip-header": (8, 8 + hlen)}[kind]
        for i in draw(st.lists(st.integers(lo, hi - 1), min_size=1, max_size=4)):
            body[i] ^= draw(st.integers(1, 255))
        return bytes(body)
    if kind == "insert":
        i = draw(st.integers(0, len(body)))
        return bytes(body[:i]) + draw(st.binary(min_size=1, max_size=16)) + bytes(body[i:])
    if kind == "value":  # the data region is all int32: overwrite one of them
        i = 8 + hlen + 4 * draw(st.integers(0, (len(body) - 8 - hlen) // 4 - 1))
        body[i:i + 4] = draw(INTERESTING).to_bytes(4, "little", signed=True)
        return bytes(body)
    header, data = split(bytes(body))
    name = draw(st.sampled_from(sorted(header)))
    if kind == "drop":
        del header[name]
    elif name == "__metadata__":
        header[name] = draw(st.dictionaries(st.sampled_from(["temperature", "x"]) | st.text(max_size=4),
                                            st.text(max_size=8) | st.floats().map(str)) | json_values)
    else:
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        header[name][field] = draw(st.sampled_from(["I32", "I64", "F32", "BOOL", "U8", "F8_E8M0", "Q7", ""])
                                   | json_values | st.lists(st.integers(0, 2**64), max_size=3))
    return join(header, data)


DTYPE_SIZES = {"I32": 4, "I64": 8, "F32": 4, "F16": 2, "BF16": 2, "U8": 1, "BOOL": 1, "F8_E8M0": 1}


@st.composite
def random_headers(draw):
    """A well-formed safetensors buffer of random tensors (names, dtypes, shapes, values); sometimes one byte
    offset is off, or the data one byte short or long, so the size checks are hit too."""
    def rarely():  # 1 in 4
        return draw(st.integers(0, 3)) == 0

    names = ["input_ids", "seq_lens", "prompt_lens"]
    if rarely():
        names = draw(st.lists(st.sampled_from(names + ["x"]), min_size=1, unique=True))
    header, data = {}, b""
    for name in names:
        dtype = draw(st.sampled_from(sorted(DTYPE_SIZES))) if rarely() else "I32"
        shape = [draw(st.integers(1, 6))]
        if rarely():  # a scalar, 2-D or empty tensor, or a 4 TiB claim (over 1 element's bytes)
            shape = draw(st.just([2**40]) | st.lists(st.integers(0, 4), max_size=3))
        numel = 1 if shape == [2**40] else math.prod(shape)
        nbytes = numel * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + nbytes]}
        data += draw(st.binary(min_size=nbytes, max_size=nbytes) if dtype != "I32" else
                     st.lists(INTERESTING, min_size=numel, max_size=numel).map(
                         lambda xs: b"".join(x.to_bytes(4, "little", signed=True) for x in xs)))
    if draw(st.booleans()):
        header["__metadata__"] = {"temperature": draw(st.sampled_from(["1.0", "0.5", "0", "-1", "inf", "x"]))}
    off = draw(st.sampled_from([0] * 6 + [-1, 1]))
    if off and draw(st.booleans()):
        data = data[:-1] if off < 0 else data + b"?"
    elif off:
        entry = header[draw(st.sampled_from(names))]["data_offsets"]
        entry[1] = max(entry[1] + off, 0)
    return join(header, data)


any_body = st.binary(max_size=256) | mutated_bodies() | random_headers() | valid_bodies()


def check_decode(body):
    """decode_request either refuses with a WireError (400/413) or returns a request within the limits; the
    tensors it parsed never hold more bytes than the body (safetensors checks shapes against offsets)."""
    try:
        prompts, completions, temperature = decode_request(body, **LIMITS)
    except WireError as e:
        assert e.status_code in (400, 413) and "\n" not in str(e)
        event(f"{e.status_code} {str(e)[:70]}")  # what got refused: pytest --hypothesis-show-statistics
        return None
    event("accepted")
    tensors, _ = read_body(body)
    assert sum(t.numel() * t.element_size() for t in tensors.values()) <= len(body)
    n_tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    assert 4 * n_tokens <= len(body) and (len(prompts) == 1 or len(prompts) * width <= LIMITS["max_tokens"])
    assert 1 <= len(prompts) == len(completions) <= LIMITS["max_seqs"]
    assert all(p and c and 0 <= min(p + c) and max(p + c) < V for p, c in zip(prompts, completions))
    assert 0 < temperature < float("inf")
    return prompts, completions, temperature


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(body):
    check_decode(body)


@FUZZ
@given(mutated_bodies())
def test_mutated_valid_bodies(body):
    check_decode(body)


@FUZZ
@given(random_headers())
def test_random_headers(body):
    check_decode(body)


@FUZZ
@given(valid_bodies())
def test_valid_bodies_decode(body):
    assert check_decode(body) is not None


HUGE = {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}  # a 4 TiB tensor


@pytest.mark.parametrize("body", [
    join({"input_ids": HUGE}, bytes(8)),
    join({"input_ids": {**HUGE, "shape": [2**62, 2**62]}}, bytes(8)),  # the size overflows 64 bits
    join({"input_ids": {**HUGE, "shape": [2**63, 0], "data_offsets": [0, 0]}}, b""),  # 0 bytes, torch refuses
    join({"input_ids": {**HUGE, "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
    (2**62).to_bytes(8, "little") + b"{}",  # a 4 EiB header
], ids=["4TiB", "overflow", "zero-size-huge-dim", "shape-vs-offsets", "header-length"])
def test_size_claims_are_checked_not_allocated(body):
    """A header that claims more than the body holds is refused from the header alone (nothing allocated)."""
    with pytest.raises(WireError, match="safetensors") as e:
        decode_request(body, **LIMITS)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300  # torch's C++ backtrace is cut off


@pytest.fixture(scope="module")
def live_app():
    """Real servers (as main() serves: ref_server.serve) with a token and /reload on, and without a token,
    serving the tiny model in this process."""
    import threading

    from demo.tiny_model import build_model, build_tokenizer
    from ref_server import make_app, parse_args, serve
    servers = []
    for flags in (["--token", "t", "--checkpoint-dir", "/nonexistent"], ["--token", ""]):
        args = parse_args(["--model", "tiny", "--port", "0", "--max-seqs", "16", "--max-tokens", "2000",
                           "--max-body-mb", "1", "--max-connections", "32", *flags])
        servers.append(serve(make_app(build_model(build_tokenizer(), seed=0).eval(), args), args))
        threading.Thread(target=servers[-1].run, daemon=True).start()
    yield [f"http://127.0.0.1:{s.effective_port}" for s in servers]
    for s in servers:
        s.close()


@settings(max_examples=60, deadline=None, database=None)
@given(auth=st.binary(max_size=24).filter(lambda b: not set(b) & set(b"\r\n\0")),
       path=st.sampled_from(["/logps", "/reload"]), which=st.integers(0, 1))
def test_any_authorization_header_is_a_4xx(live_app, auth, path, which):
    """Non-ASCII bytes in Authorization were a 500 (bottle decodes header values as UTF-8), with a token or
    without."""
    import requests
    r = requests.post(live_app[which] + path, data=b"x", headers={"Authorization": b"Bearer " + auth},
                      timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)


nested = st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n) | st.integers(1, 200_000).map(
    lambda n: b'{"path": ' + b'{"a": ' * n + b"1" + b"}" * n + b"}")


@settings(max_examples=30, deadline=None, database=None)
@given(body=nested | st.binary(max_size=64) | json_values.map(lambda v: json.dumps({"path": v}).encode()))
def test_any_reload_body_is_a_4xx(live_app, body):
    """A deeply nested JSON body was a 500 (json's RecursionError)."""
    import requests
    r = requests.post(live_app[0] + "/reload", data=body, headers={"Authorization": "Bearer t"}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
