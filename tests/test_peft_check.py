#!/usr/bin/env python3
"""Tests tools/device/peft_adapter_check.py where transformers and peft are missing (Debian has
neither): its pure parts (the executor's sequence order, the token file, the run lines, the
verdict and its refusals), and, under a Python with torch, the whole check end to end on the CPU
executor with stand-ins for the two libraries: a Llama written here from transformers'
modeling_llama.py (RMSNorm, rotate_half RoPE, grouped-query eager attention, SwiGLU, the shifted
mean cross-entropy) that saves and loads model.safetensors with Hugging Face's names, and a
PeftModel that reads adapter_config.json and adapter_model.safetensors by PEFT's names and adds
scaling · B·A·x to each target Linear (peft/tuners/lora/layer.py Linear.forward). So on this
machine our executor's loss with the adapter it trained is held to an independent torch model's
within the check's tolerance; on a GPU machine the same script runs against the real libraries.

Run: /usr/bin/python3 tests/test_peft_check.py    (PEFTPLAN=path/to/peftplan; default build/release/cli/peftplan)
"""
import contextlib
import importlib.util
import json
import math
import os
import struct
import sys
import tempfile
import types
import unittest

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHECK_PATH = os.path.join(ROOT, "tools", "device", "peft_adapter_check.py")
_spec = importlib.util.spec_from_file_location("peft_adapter_check", CHECK_PATH)
pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)

PEFTPLAN = os.environ.get("PEFTPLAN") or os.path.join(ROOT, "build", "release", "cli", "peftplan")
HAVE_PEFTPLAN = os.path.isfile(PEFTPLAN) and os.access(PEFTPLAN, os.X_OK)
HAVE_TORCH = importlib.util.find_spec("torch") is not None


class PureParts(unittest.TestCase):
    def test_sequences_follow_the_executors_order(self):
        # data.h: sequence i is tokens[i·S … i·S+S] (S+1 tokens), indices modulo the stream length.
        tokens = list(range(10))
        self.assertEqual(pc.sequences(tokens, 4, 3), [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9, 0, 1, 2]])

    def test_token_file_is_u32_little_endian(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.u32")
            tokens = pc.write_tokens(path, 7, 300, 5)
            with open(path, "rb") as f:
                raw = f.read()
            self.assertEqual(len(raw), 28)
            self.assertEqual(list(struct.unpack("<7I", raw)), tokens)
            self.assertTrue(all(0 <= t < 300 for t in tokens))
            self.assertEqual(pc.write_tokens(path, 7, 300, 5), tokens)  # seeded

    def test_run_lines_train_without_dropout_on_one_rank(self):
        ns = pc.parse_args(["--out", "o", "--peftplan", "/bin/peftplan", "--lora-alpha", "32"])
        args = pc.run_args(ns, "c.json", "w.safetensors", "d.u32", "out", 6, ["--save-adapter", "a"])
        line = " ".join(args)
        for flag in ("--gpus 1", "--strategy ddp", "--lora-dropout 0", "--lora-alpha 32", "--lora-r 16",
                     "--lora-targets q_proj,k_proj,v_proj,o_proj", "--weights w.safetensors", "--data-format u32",
                     "--steps 6", "--save-adapter a", "--rounds 1"):
            self.assertIn(flag, line)
        self.assertEqual(args[:2], ["/bin/peftplan", "run"])
        self.assertNotIn("--cluster", args)
        ns = pc.parse_args(["--out", "o", "--cluster", "1xA100-80GB"])
        self.assertIn("--cluster 1xA100-80GB", " ".join(pc.run_args(ns, "c", "w", "d", "o", 1, [])))

    def test_verdict_needs_agreement_and_a_visible_adapter(self):
        ok = pc.verdict(2.0, 2.0001, 2.1, 1e-4)  # 5e-5 apart, the adapter moves it 4.8%
        self.assertTrue(ok["pass"], ok["why"])
        far = pc.verdict(2.0, 2.001, 2.1, 1e-4)
        self.assertFalse(far["pass"])
        self.assertIn("from ours", far["why"][0])
        invisible = pc.verdict(2.0, 2.0, 2.0005, 1e-4)  # the adapter moves it 2.5e-4 < 1e-3
        self.assertFalse(invisible["pass"])
        self.assertIn("moves PEFT's loss", invisible["why"][0])

    def test_bad_arguments_exit_two(self):
        for argv in (["--out", "o", "--steps", "0"], ["--out", "o", "--lr", "0"], ["--seq-len", "8"]):
            with open(os.devnull, "w") as null, self.assertRaises(SystemExit) as e, contextlib.redirect_stderr(null):
                pc.parse_args(argv)
            self.assertEqual(e.exception.code, 2)
        with self.assertRaises(SystemExit):
            pc.zoo_config("gpt2")  # not a Llama
        self.assertEqual(pc.dtype_keyword("5.17.0"), "dtype")
        self.assertEqual(pc.dtype_keyword("4.48.1"), "torch_dtype")


# --- stand-ins for transformers and peft (torch only) -----------------------------------------

def _load_json(path):
    with open(path) as f:
        return json.load(f)


def _read_safetensors(path):
    import torch
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", t["dtype"]
        b, e = t["data_offsets"]
        values = struct.unpack(f"<{(e - b) // 4}f", raw[8 + n + b:8 + n + e])
        out[name] = torch.tensor(values, dtype=torch.float32).reshape(t["shape"])
    return out


def _write_safetensors(path, tensors):
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        data = t.detach().contiguous().float().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(chunks))


def _stand_ins():
    import torch
    from torch import nn

    class Config(types.SimpleNamespace):
        @staticmethod
        def from_pretrained(folder):
            return Config(**_load_json(os.path.join(folder, "config.json")))

    class RMSNorm(nn.Module):  # LlamaRMSNorm: fp32 variance, eps inside the root
        def __init__(self, n, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.eps = eps

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rotate_half(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    class Layer(nn.Module):
        def __init__(self, c):
            super().__init__()
            H, nh, nkv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
            d = H // nh
            self.nh, self.nkv, self.d, self.theta = nh, nkv, d, c.rope_theta
            self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
            self.self_attn = nn.Module()
            for name, o, i in (("q_proj", nh * d, H), ("k_proj", nkv * d, H), ("v_proj", nkv * d, H), ("o_proj", H, nh * d)):
                setattr(self.self_attn, name, nn.Linear(i, o, bias=False))
            self.mlp = nn.Module()
            I = c.intermediate_size
            for name, o, i in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
                setattr(self.mlp, name, nn.Linear(i, o, bias=False))

        def forward(self, x):
            B, T, _ = x.shape
            a = self.self_attn
            h = self.input_layernorm(x)
            q = a.q_proj(h).view(B, T, self.nh, self.d).transpose(1, 2)
            k = a.k_proj(h).view(B, T, self.nkv, self.d).transpose(1, 2)
            v = a.v_proj(h).view(B, T, self.nkv, self.d).transpose(1, 2)
            inv = 1.0 / (self.theta ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d))
            ang = torch.outer(torch.arange(T, dtype=torch.float32), inv)
            emb = torch.cat((ang, ang), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            rep = self.nh // self.nkv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            s = q @ k.transpose(-1, -2) / math.sqrt(self.d)
            s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
            o = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, T, -1)
            x = x + a.o_proj(o)
            m = self.mlp
            h = self.post_attention_layernorm(x)
            return x + m.down_proj(nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))

    class Llama(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            self.model.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
            self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            for p in self.parameters():  # _init_weights: normal(0, initializer_range); norms 1
                if p.dim() == 2:
                    nn.init.normal_(p, 0.0, c.initializer_range)

        def forward(self, input_ids, labels):
            x = self.model.embed_tokens(input_ids)
            for layer in self.model.layers:
                x = layer(x)
            logits = self.lm_head(self.model.norm(x))
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            return types.SimpleNamespace(loss=loss, logits=logits)

        def save_pretrained(self, folder, safe_serialization=True):
            _write_safetensors(os.path.join(folder, "model.safetensors"), self.state_dict())

    class AutoModelForCausalLM:
        @staticmethod
        def from_config(c, **kw):
            return Llama(c)

        @staticmethod
        def from_pretrained(folder, **kw):
            m = Llama(Config.from_pretrained(folder))
            m.load_state_dict(_read_safetensors(os.path.join(folder, "model.safetensors")))
            return m

    transformers = types.ModuleType("transformers")
    transformers.__version__ = "4.48.1"
    transformers.set_seed = torch.manual_seed
    transformers.AutoConfig = Config
    transformers.AutoModelForCausalLM = AutoModelForCausalLM

    class LoraLinear(nn.Module):  # peft LoraLayer: base(x) + B(A(dropout(x))) · alpha / r
        def __init__(self, base, A, B, scaling):
            super().__init__()
            self.base, self.A, self.B, self.scaling, self.enabled = base, A, B, scaling, True

        def forward(self, x):
            y = self.base(x)
            return y + (x @ self.A.t() @ self.B.t()) * self.scaling if self.enabled else y

    class PeftModel(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.base_model = model
            self.wrapped = []

        @staticmethod
        def from_pretrained(model, folder):
            cfg = _load_json(os.path.join(folder, "adapter_config.json"))
            weights = _read_safetensors(os.path.join(folder, "adapter_model.safetensors"))
            pm = PeftModel(model)
            scaling = cfg["lora_alpha"] / cfg["r"]
            prefix = "base_model.model."
            for name in sorted(weights):
                if not name.endswith(".lora_A.weight"):
                    continue
                path = name[len(prefix):-len(".lora_A.weight")]
                parent_path, leaf = path.rsplit(".", 1)
                parent = model.get_submodule(parent_path)
                lora = LoraLinear(getattr(parent, leaf), weights[name], weights[name.replace("lora_A", "lora_B")], scaling)
                setattr(parent, leaf, lora)
                pm.wrapped.append(lora)
            if not pm.wrapped:
                raise ValueError(f"no lora_A tensors under {prefix} in {folder}")
            return pm

        def forward(self, **kw):
            return self.base_model(**kw)

        @contextlib.contextmanager
        def disable_adapter(self):
            for w in self.wrapped:
                w.enabled = False
            try:
                yield
            finally:
                for w in self.wrapped:
                    w.enabled = True

    peft = types.ModuleType("peft")
    peft.PeftModel = PeftModel
    return transformers, peft


class TheBinary(unittest.TestCase):
    def test_a_named_peftplan_exists(self):
        # ctest names it (PEFTPLAN): then the end-to-end case must not be skipped for want of it.
        if "PEFTPLAN" in os.environ:
            self.assertTrue(HAVE_PEFTPLAN, f"PEFTPLAN={PEFTPLAN} is not an executable")


@unittest.skipUnless(HAVE_TORCH and HAVE_PEFTPLAN, "needs torch and the peftplan binary")
class EndToEndOnTheCpu(unittest.TestCase):
    def test_peft_loads_our_adapter_and_computes_our_loss(self):
        transformers, peft = _stand_ins()
        saved = {k: sys.modules.get(k) for k in ("transformers", "peft")}
        sys.modules.update({"transformers": transformers, "peft": peft})
        try:
            with tempfile.TemporaryDirectory() as d:
                rc = pc.main(["--out", d, "--model", "tiny-llama-4l", "--device", "cpu", "--seq-len", "64",
                              "--micro-batch", "2", "--steps", "4", "--peftplan", PEFTPLAN,
                              "--cluster", "1xA100-80GB"])  # a preset: no calibration of this machine
                result = _load_json(os.path.join(d, "peft-check.json"))
                adapter_cfg = _load_json(os.path.join(d, "adapter", "adapter_config.json"))
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v
        self.assertEqual(rc, 0, result)
        self.assertTrue(result["pass"], result["why"])
        self.assertLessEqual(abs(result["relative_error"]), 1e-4)
        self.assertGreater(abs(result["adapter_effect"]), 1e-3)
        self.assertEqual(sorted(adapter_cfg["target_modules"]), ["k_proj", "o_proj", "q_proj", "v_proj"])


if __name__ == "__main__":
    unittest.main()
