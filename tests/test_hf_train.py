#!/usr/bin/env python3
"""Tests tools/device/hf_train.py and tools/device/hf_compare.sh where they can be tested without a
GPU: the model config against the zoo (the file and `peftplan models --json`), the parameter
counts against `peftplan plan`, the argument defaults and refusals, the `peftplan plan` flags it
writes (they must plan, and describe the same model as `--model tinyllama-1.1b`), the
TrainingArguments spelling for transformers 4.x and 5.x, and hf_compare.sh end to end on a
measurement the callback's Recorder writes on the CPU. The training itself needs transformers,
peft and accelerate: its test is skipped without them (Debian has none of them).

Run: /usr/bin/python3 tests/test_hf_train.py     (or python3 -m unittest tests/test_hf_train.py)
     PEFTPLAN=path/to/peftplan selects the binary (default build/release/cli/peftplan); without
     one the tests that run it are skipped.
"""
import dataclasses
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
import unittest
from unittest import mock

sys.dont_write_bytecode = True  # no __pycache__ left in tools/device by a test run
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAIN_PATH = os.path.join(ROOT, "tools", "device", "hf_train.py")
COMPARE_SH = os.path.join(ROOT, "tools", "device", "hf_compare.sh")
ZOO_DIR = os.path.join(ROOT, "models", "zoo")

_spec = importlib.util.spec_from_file_location("hf_train", TRAIN_PATH)
ht = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ht)

PEFTPLAN = os.environ.get("PEFTPLAN") or os.path.join(ROOT, "build", "release", "cli", "peftplan")
HAVE_PEFTPLAN = os.path.isfile(PEFTPLAN) and os.access(PEFTPLAN, os.X_OK)
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_HF = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "peft", "accelerate"))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def zoo(name):
    with open(os.path.join(ZOO_DIR, name + ".json"), encoding="utf-8") as f:
        return json.load(f)


def peftplan(*args, check=True):
    p = subprocess.run([PEFTPLAN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"peftplan {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


class ConfigTest(unittest.TestCase):
    def test_embedded_config_is_the_zoo_file(self):
        self.assertEqual(ht.ZOO_NAME, "tinyllama-1.1b")
        self.assertEqual(ht.TINYLLAMA_CONFIG, zoo(ht.ZOO_NAME))
        self.assertEqual(ht.model_config(), zoo(ht.ZOO_NAME))
        c = ht.model_config()
        c["hidden_size"] = 1
        self.assertEqual(ht.TINYLLAMA_CONFIG["hidden_size"], 2048, "model_config() must return a copy")

    def test_parameter_counts_by_hand(self):
        # TinyLlama-1.1B: 32000*2048 embedding and head; per layer q 2048*2048, k and v 2048*256,
        # o 2048*2048, gate/up/down 3*2048*5632, two norms; the final norm.
        layer = 2048 * 2048 * 2 + 2048 * 256 * 2 + 3 * 2048 * 5632 + 2 * 2048
        self.assertEqual(ht.count_parameters(ht.TINYLLAMA_CONFIG), 2 * 32000 * 2048 + 22 * layer + 2048)
        self.assertEqual(ht.count_parameters(ht.TINYLLAMA_CONFIG), 1_100_048_384)  # SOURCES.md: published
        # LoRA r 16 on q, k, v, o: 16 * ((2048+2048) + (2048+256) * 2 + (2048+2048)) per layer.
        self.assertEqual(ht.lora_trainable_parameters(ht.TINYLLAMA_CONFIG, 16, TARGETS), 22 * 16 * (4096 * 2 + 2304 * 2))
        self.assertEqual(ht.lora_trainable_parameters(ht.TINYLLAMA_CONFIG, 16, TARGETS), 4_505_600)

    def test_tied_and_bias_counts(self):
        tied = zoo("tiny-llama-tied")
        self.assertTrue(tied["tie_word_embeddings"])
        c = dict(ht.TINYLLAMA_CONFIG, tie_word_embeddings=True)
        self.assertEqual(ht.count_parameters(c), ht.count_parameters(ht.TINYLLAMA_CONFIG) - 32000 * 2048)
        c = dict(ht.TINYLLAMA_CONFIG, attention_bias=True)
        self.assertEqual(ht.count_parameters(c), ht.count_parameters(ht.TINYLLAMA_CONFIG) + 22 * (2048 + 256 + 256 + 2048))

    @unittest.skipUnless(HAVE_PEFTPLAN, f"no peftplan binary at {PEFTPLAN}")
    def test_config_is_the_model_peftplan_lists(self):
        rows = json.loads(peftplan("models", "--json").stdout)
        row = next(r for r in rows if r["name"] == ht.ZOO_NAME)
        c = ht.TINYLLAMA_CONFIG
        self.assertEqual(row["model_type"], c["model_type"])
        self.assertEqual(row["hidden"], c["hidden_size"])
        self.assertEqual(row["layers"], c["num_hidden_layers"])
        self.assertEqual(row["heads"], c["num_attention_heads"])
        self.assertEqual(row["kv_heads"], c["num_key_value_heads"])
        self.assertEqual(row["total_params"], ht.count_parameters(c))
        # Every Llama of the zoo: peftplan's count is ours (the formula is not TinyLlama's alone).
        for r in rows:
            if r["model_type"] == "llama":
                self.assertEqual(r["total_params"], ht.count_parameters(zoo(r["name"])), r["name"])


class ArgumentsTest(unittest.TestCase):
    def test_defaults(self):
        ns = ht.parse_args(["--out", "x"])
        self.assertEqual((ns.steps, ns.micro_batch, ns.seq_len, ns.grad_accum), (12, 4, 1024, 1))
        self.assertEqual((ns.lora_r, ns.lora_alpha, ns.lora_dropout), (16, 16.0, 0.1))
        self.assertEqual(ns.targets, TARGETS)
        self.assertFalse(ns.gradient_checkpointing)
        self.assertFalse(ns.use_cache)
        self.assertFalse(ns.cpu)
        self.assertEqual(ns.attn_implementation, "sdpa")
        self.assertEqual(ns.cluster, "auto")
        self.assertEqual((ns.seed, ns.warmup_steps), (0, 2))
        self.assertIsNone(ns.config)
        self.assertEqual(ns.config_obj, ht.TINYLLAMA_CONFIG)

    def test_flags(self):
        ns = ht.parse_args(["--out", "x", "--steps", "5", "--micro-batch", "2", "--seq-len", "256",
                            "--grad-accum", "3", "--gradient-checkpointing", "--lora-r", "8", "--lora-alpha", "32",
                            "--lora-dropout", "0", "--lora-targets", " q_proj , v_proj ", "--attn-implementation",
                            "eager", "--warmup-steps", "1", "--config", os.path.join(ZOO_DIR, "tiny-llama-4l.json")])
        self.assertEqual((ns.steps, ns.micro_batch, ns.seq_len, ns.grad_accum), (5, 2, 256, 3))
        self.assertEqual(ns.targets, ["q_proj", "v_proj"])
        self.assertEqual(ns.config_obj, zoo("tiny-llama-4l"))
        self.assertEqual(ht.model_name(ns), "tiny-llama-4l")
        self.assertEqual(ht.model_name(ht.parse_args(["--out", "x"])), "tinyllama-1.1b")
        with tempfile.TemporaryDirectory() as tmp:
            os.mkdir(os.path.join(tmp, "my-llama"))
            path = os.path.join(tmp, "my-llama", "config.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(zoo("tiny-llama-4l"), f)
            self.assertEqual(ht.model_name(ht.parse_args(["--out", "x", "--config", path])), "my-llama")

    def test_refusals(self):
        bad = [[],  # --out is required
               ["--steps", "0"], ["--micro-batch", "-1"], ["--seq-len", "x"], ["--lora-dropout", "1"],
               ["--lora-alpha", "0"], ["--lora-targets", "q_proj,lm_head"], ["--lora-targets", ","],
               ["--lora-targets", "q_proj,q_proj"], ["--seq-len", "2049"],  # TinyLlama: 2048 positions
               ["--warmup-steps", "12"], ["--attn-implementation", "flash"],
               ["--config", os.path.join(ZOO_DIR, "gpt2.json")], ["--config", os.path.join(ZOO_DIR, "nope.json")]]
        for extra in bad:
            argv = extra if not extra else ["--out", "x"] + extra
            with self.subTest(argv=argv):
                with open(os.devnull, "w") as devnull:
                    stderr, sys.stderr = sys.stderr, devnull
                    try:
                        with self.assertRaises(SystemExit) as cm:
                            ht.parse_args(argv)
                    finally:
                        sys.stderr = stderr
                self.assertEqual(cm.exception.code, 2)

    def test_cluster_for_gpu(self):
        self.assertEqual(ht.cluster_for_gpu("NVIDIA H200"), "1xH200")
        self.assertEqual(ht.cluster_for_gpu("NVIDIA H100 80GB HBM3"), "1xH100-SXM")
        self.assertEqual(ht.cluster_for_gpu("NVIDIA H100 PCIe"), "1xH100-PCIe")
        self.assertEqual(ht.cluster_for_gpu("NVIDIA A100-SXM4-80GB"), "1xA100-80GB")
        self.assertEqual(ht.cluster_for_gpu("NVIDIA A100-SXM4-40GB"), "1xA100-40GB")
        self.assertEqual(ht.cluster_for_gpu("NVIDIA L40S"), "1xL40S")
        self.assertEqual(ht.cluster_for_gpu("NVIDIA L4"), "1xL4")
        self.assertEqual(ht.cluster_for_gpu("NVIDIA GeForce RTX 4090"), "1xRTX4090")
        self.assertIsNone(ht.cluster_for_gpu("Tesla T4"))
        self.assertIsNone(ht.cluster_for_gpu(None))

    def test_plan_args(self):
        ns = ht.parse_args(["--out", "x"])
        args = ht.plan_args(ns, "/o/config.json", "1xH200", environ={})
        flags = dict(zip(args[::2], args[1::2]))
        self.assertEqual(len(args), 2 * len(flags), "every flag takes one value")
        self.assertEqual(flags, {
            "--model": "/o/config.json", "--lora-r": "16", "--lora-alpha": "16", "--lora-dropout": "0.1",
            "--lora-targets": "q_proj,k_proj,v_proj,o_proj", "--cluster": "1xH200", "--gpus": "1",
            "--strategy": "ddp", "--profile": "hf", "--precision": "bf16", "--optimizer": "adamw",
            "--micro-batch": "4", "--seq-len": "1024", "--grad-accum": "1", "--checkpointing": "none",
            "--attention": "flash", "--eval-batch": "0"})
        ns = ht.parse_args(["--out", "x", "--gradient-checkpointing", "--attn-implementation", "eager",
                            "--lora-alpha", "32.5"])
        flags = dict(zip(*[iter(ht.plan_args(ns, "c.json", "1xH100-SXM",
                                             environ={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}))] * 2))
        self.assertEqual(flags["--checkpointing"], "full")
        self.assertEqual(flags["--attention"], "eager")
        self.assertEqual(flags["--lora-alpha"], "32.5")
        self.assertEqual(flags["--alloc-conf"], "expandable_segments:True")

    def test_print_plan_args_needs_no_torch(self):
        p = subprocess.run([sys.executable, "-S", TRAIN_PATH, "--out", "/nowhere/o", "--print-plan-args"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60,
                           env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.splitlines()
        self.assertEqual(lines[:2], ["--model", "/nowhere/o/tinyllama-1.1b/config.json"])
        self.assertIn("--profile", lines)


class VersionsTest(unittest.TestCase):
    FIELDS_4 = ["output_dir", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
                "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "optim", "bf16", "fp16",
                "gradient_checkpointing", "gradient_checkpointing_kwargs", "logging_strategy", "logging_steps",
                "save_strategy", "report_to", "seed", "data_seed", "dataloader_num_workers", "disable_tqdm",
                "label_names", "remove_unused_columns", "torch_compile", "evaluation_strategy", "no_cuda"]
    FIELDS_5 = [f for f in FIELDS_4 if f not in ("evaluation_strategy", "no_cuda")] + ["eval_strategy", "use_cpu"]

    def test_major_version(self):
        self.assertEqual(ht.major_version("4.48.1"), 4)
        self.assertEqual(ht.major_version("5.0.0rc1"), 5)
        self.assertEqual(ht.major_version("10.1"), 10)
        self.assertIsNone(ht.major_version(None))
        self.assertIsNone(ht.major_version("dev"))

    def test_dtype_keyword(self):
        self.assertEqual(ht.dtype_keywords("5.2.0"), ("dtype", "torch_dtype"))
        self.assertEqual(ht.dtype_keywords("4.48.1"), ("torch_dtype", "dtype"))
        self.assertEqual(ht.dtype_keywords(None), ("torch_dtype", "dtype"))

    def test_training_arguments_5(self):
        ns = ht.parse_args(["--out", "x", "--cpu"])
        kw, dropped = ht.training_arguments_kwargs(ns, "/o/trainer", self.FIELDS_5)
        self.assertEqual(dropped, [])
        self.assertEqual(kw["eval_strategy"], "no")
        self.assertTrue(kw["use_cpu"])
        self.assertNotIn("evaluation_strategy", kw)
        self.assertNotIn("no_cuda", kw)
        self.assertNotIn("gradient_checkpointing_kwargs", kw)
        self.assertEqual((kw["max_steps"], kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"]), (12, 4, 1))
        self.assertEqual((kw["optim"], kw["bf16"], kw["fp16"], kw["report_to"], kw["save_strategy"]),
                         ("adamw_torch", True, False, "none", "no"))
        self.assertEqual(kw["output_dir"], "/o/trainer")

    def test_training_arguments_4(self):
        ns = ht.parse_args(["--out", "x", "--gradient-checkpointing"])
        kw, dropped = ht.training_arguments_kwargs(ns, "/o/trainer", self.FIELDS_4)
        self.assertEqual(dropped, [])
        self.assertEqual(kw["evaluation_strategy"], "no")
        self.assertNotIn("eval_strategy", kw)
        self.assertNotIn("no_cuda", kw)  # not --cpu
        self.assertTrue(kw["gradient_checkpointing"])
        self.assertEqual(kw["gradient_checkpointing_kwargs"], {"use_reentrant": True})

    def test_unknown_fields_are_dropped(self):
        ns = ht.parse_args(["--out", "x"])
        fields = [f for f in self.FIELDS_5 if f not in ("data_seed", "torch_compile")]
        kw, dropped = ht.training_arguments_kwargs(ns, "o", fields)
        self.assertEqual(dropped, ["data_seed", "torch_compile"])
        self.assertTrue(set(kw) <= set(fields))


@unittest.skipUnless(HAVE_PEFTPLAN, f"no peftplan binary at {PEFTPLAN}")
class PlanTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def test_plan_args_plan_the_zoo_model(self):
        ns = ht.parse_args(["--out", self.tmp.name])
        paths = ht.prepare_out_dir(ns, "1xH200")
        self.assertEqual(paths["config"], os.path.join(os.path.abspath(self.tmp.name), "tinyllama-1.1b", "config.json"))
        with open(paths["config"], encoding="utf-8") as f:
            self.assertEqual(json.load(f), ht.TINYLLAMA_CONFIG)
        with open(paths["plan_args"], encoding="utf-8") as f:
            args = f.read().splitlines()
        plan_json = os.path.join(self.tmp.name, "plan.json")
        out = json.loads(peftplan("plan", *args, "--write-plan", plan_json, "--json").stdout)
        self.assertEqual(out["params"]["base_params"], ht.count_parameters(ht.TINYLLAMA_CONFIG))
        self.assertEqual(out["params"]["trainable_params"], ht.lora_trainable_parameters(ht.TINYLLAMA_CONFIG, 16, TARGETS))
        self.assertEqual(out["profile"], "hf")
        # The config file plans exactly as the zoo name does.
        zoo_args = list(args)
        zoo_args[zoo_args.index("--model") + 1] = ht.ZOO_NAME
        by_name = json.loads(peftplan("plan", *zoo_args, "--json").stdout)
        self.assertEqual(out["memory"], by_name["memory"])
        self.assertEqual(out["time"], by_name["time"])
        with open(plan_json, encoding="utf-8") as f:
            plan = json.load(f)
        self.assertEqual(plan["model"], ht.TINYLLAMA_CONFIG)  # the config object, embedded
        self.assertEqual(plan["training"]["micro_batch"], 4)
        self.assertEqual(plan["training"]["seq_len"], 1024)
        self.assertEqual(plan["training"]["checkpointing"], "none")
        self.assertEqual(plan["ranks"], 1)

    def test_mapped_clusters_exist(self):
        for _, cluster in ht.GPU_CLUSTERS:
            with self.subTest(cluster=cluster):
                peftplan("plan", "--model", "tiny-llama-4l", "--cluster", cluster, "--profile", "hf", "--json")

    @unittest.skipUnless(HAVE_TORCH, "no torch in this Python (the callback needs it)")
    def test_compare_script_on_a_cpu_measurement(self):
        """hf_compare.sh on OUT as hf_train.py leaves it, the measurement written by the callback's
        Recorder (what PeftplanCallback drives) from timed sleeps on the CPU."""
        ns = ht.parse_args(["--out", self.tmp.name, "--steps", "6"])
        paths = ht.prepare_out_dir(ns, "1xH200")
        sys.path.insert(0, ht.CALLBACK_DIR)
        try:
            import peftplan_callback as pc
        finally:
            sys.path.remove(ht.CALLBACK_DIR)
        rec = pc.Recorder()
        rec.start(tokens_per_step=ns.micro_batch * ns.seq_len)
        for _ in range(ns.steps):
            time.sleep(0.06)  # about the planned step on an H200
            rec.record_step()
        doc = rec.write_measurement(paths["measurement"], config_path=paths["config"], warmup_steps=ns.warmup_steps)
        self.assertEqual(doc["model"]["config_sha256"], pc.config_sha256(zoo(ht.ZOO_NAME)))
        p = subprocess.run(["bash", COMPARE_SH, self.tmp.name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=120, env=dict(os.environ, PEFTPLAN=PEFTPLAN))
        self.assertEqual(p.returncode, 0, p.stdout)
        self.assertIn("note: model: the config.json hash matches the plan's", p.stdout)
        self.assertRegex(p.stdout, r"hf_compare: compare exit [01] ")
        self.assertIn("tokens_per_s_per_gpu", p.stdout)
        self.assertIn("plan: tinyllama-1.1b ·", p.stdout)  # named as the zoo names it
        self.assertIn("profile hf models:", p.stdout)
        for f in ("plan.json", "plan-output.json", "plan.txt", "compare/validation.json", "compare/report.md"):
            self.assertTrue(os.path.isfile(os.path.join(self.tmp.name, f)), f)

    def test_compare_script_refuses_a_missing_measurement(self):
        ns = ht.parse_args(["--out", self.tmp.name])
        ht.prepare_out_dir(ns, "1xH200")
        p = subprocess.run(["bash", COMPARE_SH, self.tmp.name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=60, env=dict(os.environ, PEFTPLAN=PEFTPLAN))
        self.assertEqual(p.returncode, 2, p.stdout)
        self.assertIn("measurement.json is missing", p.stdout)


def stand_in_libraries(seen):
    """Stand-in transformers and peft modules with the few names hf_train.py uses, the model a
    small Llama-shaped stack with the config's real Linear shapes (so that the parameter counts
    are real), the Trainer a plain loop calling the callbacks as transformers' does. They test
    hf_train.py's plumbing (arguments, files, the callback, the report), not transformers.
    seen collects what hf_train.py passed them."""
    import torch
    import torch.nn.functional as F

    tf = types.ModuleType("transformers")
    tf.__version__ = "5.0.0"

    class TrainerCallback:
        def on_train_begin(self, args, state, control, **kwargs):
            pass

        def on_step_end(self, args, state, control, **kwargs):
            pass

        def on_train_end(self, args, state, control, **kwargs):
            pass

    class Config:
        def __init__(self, d):
            self.__dict__.update(d)
            self.name_or_path = ""

        def to_dict(self):
            return {k: v for k, v in self.__dict__.items() if k != "name_or_path"}

    class AutoConfig:
        @staticmethod
        def from_pretrained(folder):
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                c = Config(json.load(f))
            c.name_or_path = folder
            return c

    class Layer(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            for name, (i, o) in ht.projection_shapes(config.__dict__).items():
                setattr(self, name, torch.nn.Linear(i, o, bias=False))
            self.input_layernorm = torch.nn.Parameter(torch.ones(config.hidden_size))
            self.post_attention_layernorm = torch.nn.Parameter(torch.ones(config.hidden_size))

        def forward(self, h):
            h = h + self.o_proj(self.q_proj(h * self.input_layernorm))
            x = h * self.post_attention_layernorm
            return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class CausalLM(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = torch.nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
            self.norm = torch.nn.Parameter(torch.ones(config.hidden_size))
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        def enable_input_require_grads(self):
            seen["enable_input_require_grads"] = True

        def forward(self, input_ids, attention_mask=None, labels=None):
            h = self.embed_tokens(input_ids)
            for layer in self.layers:
                h = layer(h)
            logits = self.lm_head(h * self.norm).float()
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            return types.SimpleNamespace(loss=loss, logits=logits)

    class AutoModelForCausalLM:
        @staticmethod
        def from_config(config, dtype=None, attn_implementation=None, **kwargs):
            if kwargs:  # transformers 5 passes unknown keywords to the model's __init__
                raise TypeError(f"__init__() got an unexpected keyword argument {next(iter(kwargs))!r}")
            seen["from_config"] = {"dtype": dtype, "attn_implementation": attn_implementation}
            config._attn_implementation = attn_implementation
            return CausalLM(config).to(dtype)

    fields = VersionsTest.FIELDS_5
    TrainingArguments = dataclasses.make_dataclass(
        "TrainingArguments", [(f, object, dataclasses.field(default=None)) for f in fields])

    def set_seed(seed):
        torch.manual_seed(seed)

    def default_data_collator(features):
        return {k: torch.stack([f[k] for f in features]) for k in features[0]}

    class Trainer:
        def __init__(self, model, args, train_dataset, data_collator, callbacks):
            seen["training_arguments"] = dataclasses.asdict(args)
            self.model, self.args, self.data, self.collate, self.callbacks = model, args, train_dataset, data_collator, callbacks
            self.state = types.SimpleNamespace(log_history=[])

        def train(self):
            params = [p for p in self.model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=self.args.learning_rate)
            b = self.args.per_device_train_batch_size
            for cb in self.callbacks:
                cb.on_train_begin(self.args, self.state, None, model=self.model)
            for step in range(self.args.max_steps):
                batch = self.collate([self.data[(step * b + i) % len(self.data)] for i in range(b)])
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = self.model(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                self.state.log_history.append({"loss": loss.item(), "step": step + 1})
                for cb in self.callbacks:
                    cb.on_step_end(self.args, self.state, None, model=self.model)
            for cb in self.callbacks:
                cb.on_train_end(self.args, self.state, None, model=self.model)
            return types.SimpleNamespace(metrics={"train_loss": loss.item()})

    for name, value in dict(TrainerCallback=TrainerCallback, AutoConfig=AutoConfig, AutoModelForCausalLM=AutoModelForCausalLM,
                            TrainingArguments=TrainingArguments, Trainer=Trainer, set_seed=set_seed,
                            default_data_collator=default_data_collator).items():
        setattr(tf, name, value)

    peft = types.ModuleType("peft")
    peft.__version__ = "0.0-stand-in"

    class LoraConfig:
        def __init__(self, **kw):
            seen["lora"] = kw
            self.__dict__.update(kw)

    class Lora(torch.nn.Module):
        def __init__(self, base, r):
            super().__init__()
            self.base = base
            self.lora_A = torch.nn.Parameter(torch.zeros(r, base.in_features))
            self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, r))

        def forward(self, x):
            return self.base(x) + (x.float() @ self.lora_A.t() @ self.lora_B.t()).to(x.dtype)

    class PeftModel(torch.nn.Module):
        def __init__(self, model, cfg):
            super().__init__()
            for p in model.parameters():
                p.requires_grad_(False)
            for layer in model.layers:
                for t in cfg.target_modules:
                    setattr(layer, t, Lora(getattr(layer, t), cfg.r))
            self.base_model = model
            self.config = model.config

        def get_nb_trainable_parameters(self):
            ps = list(self.parameters())
            return sum(p.numel() for p in ps if p.requires_grad), sum(p.numel() for p in ps)

        def forward(self, **kw):
            return self.base_model(**kw)

    peft.LoraConfig = LoraConfig
    peft.get_peft_model = PeftModel
    return {"transformers": tf, "peft": peft}


@unittest.skipUnless(HAVE_TORCH, "no torch in this Python")
class StandInTrainTest(unittest.TestCase):
    def test_train_against_stand_ins(self):
        """hf_train.py's main() end to end on the CPU with the zoo's tiny-llama-4l, transformers
        and peft replaced by stand-ins (stand_in_libraries)."""
        seen = {}
        modules = stand_in_libraries(seen)
        with tempfile.TemporaryDirectory() as tmp, \
                mock.patch.dict(sys.modules, modules), mock.patch.dict(os.environ, {}):
            sys.modules.pop("peftplan_callback", None)  # made afresh against the stand-in TrainerCallback
            out = os.path.join(tmp, "o")
            with open(os.devnull, "w") as devnull, mock.patch("sys.stdout", devnull):
                rc = ht.main(["--out", out, "--config", os.path.join(ZOO_DIR, "tiny-llama-4l.json"), "--cpu",
                              "--steps", "4", "--warmup-steps", "1", "--micro-batch", "2", "--seq-len", "16",
                              "--gradient-checkpointing"])
            self.assertEqual(os.environ.get("HF_HUB_OFFLINE"), "1")
            sys.modules.pop("peftplan_callback", None)
            with open(os.path.join(out, "measurement.json"), encoding="utf-8") as f:
                doc = json.load(f)
            with open(os.path.join(out, "run.json"), encoding="utf-8") as f:
                run = json.load(f)
            with open(os.path.join(out, "plan-args.txt"), encoding="utf-8") as f:
                args = f.read().splitlines()
        self.assertEqual(rc, 0)
        cfg = zoo("tiny-llama-4l")
        self.assertEqual((doc["steps"], doc["warmup_steps"], doc["tokens_per_step"], doc["world_size"]), (4, 1, 32, 1))
        self.assertEqual(doc["model"]["config_source"], "file")
        canonical = json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        self.assertEqual(doc["model"]["config_sha256"], hashlib.sha256(canonical).hexdigest())  # the zoo file's
        self.assertEqual(doc["model"]["architecture"]["num_hidden_layers"], cfg["num_hidden_layers"])
        self.assertIsNotNone(doc["max"]["step_s"])
        self.assertEqual(run["params"]["base"], ht.count_parameters(cfg))
        self.assertEqual(run["params"]["trainable"], ht.lora_trainable_parameters(cfg, 16, TARGETS))
        self.assertEqual(run["params"]["adapter_dtypes"], ["torch.float32"])
        self.assertEqual(len(run["losses"]), 4)
        self.assertEqual(run["cluster"], "1xH200")
        self.assertEqual(run["config_path"], os.path.join(out, "tiny-llama-4l", "config.json"))
        self.assertEqual(args[args.index("--model") + 1], run["config_path"])
        self.assertEqual(args[args.index("--checkpointing") + 1], "full")
        self.assertEqual(seen["from_config"]["attn_implementation"], "sdpa")
        self.assertEqual(str(seen["from_config"]["dtype"]), "torch.bfloat16")
        self.assertEqual(seen["lora"], {"r": 16, "lora_alpha": 16.0, "lora_dropout": 0.1, "target_modules": TARGETS,
                                        "bias": "none", "task_type": "CAUSAL_LM"})
        self.assertTrue(seen["enable_input_require_grads"])
        ta = seen["training_arguments"]
        self.assertEqual((ta["max_steps"], ta["per_device_train_batch_size"], ta["eval_strategy"], ta["use_cpu"]),
                         (4, 2, "no", True))
        self.assertEqual(ta["gradient_checkpointing_kwargs"], {"use_reentrant": True})


@unittest.skipUnless(HAVE_HF, "needs torch, transformers, peft and accelerate (not in Debian)")
class TrainTest(unittest.TestCase):
    def test_tiny_model_on_the_cpu(self):
        """The whole script on the CPU with the zoo's 4-layer Llama: 3 steps of 2 x 32 tokens."""
        with tempfile.TemporaryDirectory() as tmp:
            rc = ht.main(["--out", tmp, "--config", os.path.join(ZOO_DIR, "tiny-llama-4l.json"), "--cpu",
                          "--steps", "3", "--warmup-steps", "1", "--micro-batch", "2", "--seq-len", "32"])
            self.assertEqual(rc, 0)
            with open(os.path.join(tmp, "measurement.json"), encoding="utf-8") as f:
                doc = json.load(f)
            self.assertEqual(doc["steps"], 3)
            self.assertEqual(doc["tokens_per_step"], 64)
            with open(os.path.join(tmp, "run.json"), encoding="utf-8") as f:
                run = json.load(f)
            cfg = zoo("tiny-llama-4l")
            self.assertEqual(run["params"]["base"], ht.count_parameters(cfg))
            self.assertEqual(run["params"]["trainable"], ht.lora_trainable_parameters(cfg, 16, TARGETS))


if __name__ == "__main__":
    unittest.main()
