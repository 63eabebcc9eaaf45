#!/usr/bin/env python3
"""Tests the launch files `peftplan recommend --emit` writes, by running the emitted train.py
against stand-in transformers, peft and datasets modules (Debian has none of them; a GPU machine
runs the real ones) with the real torch. The stand-ins record every call, so the tests see what
transformers would be handed and in which order:

- the Trainer's arguments say what ds_config.json says (transformers' trainer_config_process,
  integrations/deepspeed.py, refuses a mismatch: gradient_clipping against max_grad_norm,
  bf16.enabled against bf16, the optimizer's lr, betas, eps and weight decay, the batch sizes);
- TrainingArguments exists before from_pretrained (ZeRO-3's zero.Init reads it);
- QLoRA without sharded parameters puts each rank's copy on its own GPU (device_map) and runs
  prepare_model_for_kbit_training; sharded QLoRA (FSDP, ZeRO-3) does neither;
- every-k checkpointing wraps layers 0, k, 2k... with the plan's reentrancy, and the wrapped
  layer computes what the layer computes, gradients included (real torch.utils.checkpoint);
- fp32 with flash attention loads SDPA (flash-attn 2 has no fp32 kernels); 8-bit AdamW and
  chunked cross-entropy reach the Trainer; a model path with quotes and backslashes stays one
  string; several machines launch without DeepSpeed's ssh launcher; an FSDP row has no torchrun
  line (its settings live in accelerate's YAML).

Run: /usr/bin/python3 tests/test_launch_files.py   (PEFTPLAN=path/to/peftplan; default
     build/release/cli/peftplan)
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import unittest
from unittest import mock

import torch

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEFTPLAN = os.environ.get("PEFTPLAN") or os.path.join(ROOT, "build", "release", "cli", "peftplan")


def emit(folder, *args):
    p = subprocess.run([PEFTPLAN, "recommend", *args, "--top", "1", "--emit", folder], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300)
    if p.returncode != 0:
        raise AssertionError(f"peftplan recommend {' '.join(args)} exited {p.returncode}:\n{p.stdout}")
    return folder


class Layer(torch.nn.Module):
    """A decoder layer's calling convention: hidden states positional, the rest by keyword."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.5, -0.5, 2.0]))

    def forward(self, hidden, attention_mask=None):
        return torch.tanh(hidden * self.w) + attention_mask


class StandIns:
    """transformers, peft and datasets as far as train.py calls them; every call in `calls`."""

    def __init__(self, layers=4):
        self.calls = []
        self.layers = [Layer() for _ in range(layers)]
        calls, stand = self.calls, self

        class Model:
            def __init__(self):
                self.config = types.SimpleNamespace(use_cache=True)

            def get_decoder(self):
                return types.SimpleNamespace(layers=stand.layers)

            def enable_input_require_grads(self):
                calls.append(("enable_input_require_grads", {}))

            def print_trainable_parameters(self):
                pass

        class AutoModelForCausalLM:
            @staticmethod
            def from_pretrained(name, **kw):
                calls.append(("from_pretrained", dict(kw, name=name)))
                stand.model = Model()
                return stand.model

        class Tokenizer:
            pad_token = None
            eos_token = "</s>"
            eos_token_id = 2

            def __call__(self, text, add_special_tokens=False):
                return {"input_ids": [ord(c) % 97 for c in text]}

        class AutoTokenizer:
            @staticmethod
            def from_pretrained(name):
                calls.append(("tokenizer", {"name": name}))
                return Tokenizer()

        class TrainingArguments:
            def __init__(self, **kw):
                calls.append(("TrainingArguments", kw))
                self.kw = kw

        class Trainer:
            def __init__(self, **kw):
                calls.append(("Trainer", kw))

            def train(self):
                calls.append(("train", {}))

        class BitsAndBytesConfig:
            def __init__(self, **kw):
                self.kw = kw

        tf = types.ModuleType("transformers")
        tf.AutoModelForCausalLM, tf.AutoTokenizer, tf.Trainer = AutoModelForCausalLM, AutoTokenizer, Trainer
        tf.TrainingArguments, tf.BitsAndBytesConfig, tf.default_data_collator = TrainingArguments, BitsAndBytesConfig, None

        peft = types.ModuleType("peft")

        class PeftConfig:
            @staticmethod
            def from_pretrained(folder):
                with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as f:
                    return json.load(f)

        def get_peft_model(model, config):
            calls.append(("get_peft_model", {"config": config}))
            return model

        def prepare_model_for_kbit_training(model, **kw):
            calls.append(("prepare_model_for_kbit_training", kw))
            return model

        peft.PeftConfig, peft.get_peft_model, peft.prepare_model_for_kbit_training = PeftConfig, get_peft_model, prepare_model_for_kbit_training

        datasets = types.ModuleType("datasets")
        datasets.Dataset = types.SimpleNamespace(from_dict=lambda d: d)
        datasets.load_dataset = None
        self.modules = {"transformers": tf, "peft": peft, "datasets": datasets}

    def named(self, name):
        return [kw for n, kw in self.calls if n == name]

    def order(self):
        return [n for n, _ in self.calls]


def run_train(folder, local_rank="3"):
    """Runs folder/train.py's main() against the stand-ins; returns them."""
    s = StandIns()
    data = os.path.join(folder, "data.txt")
    with open(data, "w", encoding="utf-8") as f:
        f.write("the quick brown fox jumps over the lazy dog " * 400)
    spec = importlib.util.spec_from_file_location("emitted_train", os.path.join(folder, "train.py"))
    mod = importlib.util.module_from_spec(spec)
    with mock.patch.dict(sys.modules, s.modules), mock.patch.dict(os.environ, {"LOCAL_RANK": local_rank}), \
            mock.patch.object(sys, "argv", ["train.py", "--data", data, "--max-steps", "2"]):
        spec.loader.exec_module(mod)
        mod.main()
    s.plan = mod.PLAN
    return s


def read(folder, name):
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        return f.read()


@unittest.skipUnless(os.access(PEFTPLAN, os.X_OK), f"no peftplan binary at {PEFTPLAN}")
class EmittedTrainPy(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="peftplan-launch-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def folder(self, name):
        return os.path.join(self.tmp, name)

    def assert_matches_ds_config(self, folder, s):
        ds = json.loads(read(folder, "ds_config.json"))
        (ta,) = s.named("TrainingArguments")
        self.assertEqual(ta["deepspeed"], os.path.join(folder, "ds_config.json"))
        self.assertEqual(ta["max_grad_norm"], ds["gradient_clipping"])
        self.assertEqual(ta["bf16"], ds.get("bf16", {}).get("enabled", False))
        self.assertEqual(ta["fp16"], ds.get("fp16", {}).get("enabled", False))
        self.assertEqual(ta["per_device_train_batch_size"], ds["train_micro_batch_size_per_gpu"])
        self.assertEqual(ta["gradient_accumulation_steps"], ds["gradient_accumulation_steps"])
        if "optimizer" in ds and ds["optimizer"]["type"] == "AdamW":
            p = ds["optimizer"]["params"]
            self.assertEqual(ta["learning_rate"], p["lr"])
            self.assertEqual([ta["adam_beta1"], ta["adam_beta2"]], p["betas"])
            self.assertEqual(ta["adam_epsilon"], p["eps"])
            self.assertEqual(ta["weight_decay"], p["weight_decay"])
        return ta, ds

    def test_zero3_arguments_come_first_and_match_the_ds_config(self):
        f = emit(self.folder("zero3"), "--model", "llama-2-70b", "--lora-r", "16", "--seq-len", "4096", "--cluster", "8xA100-80GB",
                 "--strategy", "zero3")
        s = run_train(f)
        ta, ds = self.assert_matches_ds_config(f, s)
        self.assertEqual(ds["zero_optimization"]["stage"], 3)
        self.assertLess(s.order().index("TrainingArguments"), s.order().index("from_pretrained"))
        (load,) = s.named("from_pretrained")
        self.assertEqual(load["name"], "meta-llama/Llama-2-70b-hf")
        self.assertNotIn("device_map", load)
        self.assertEqual(load["torch_dtype"], torch.bfloat16)
        self.assertEqual(load["attn_implementation"], "flash_attention_2")
        self.assertFalse(s.model.config.use_cache)
        self.assertEqual(ta["optim"], "adamw_torch")
        self.assertFalse(ta["ddp_find_unused_parameters"])  # reentrant checkpointing under DDP needs it off
        self.assertEqual(s.order()[-1], "train")

    def test_pure_bf16_under_deepspeed_says_bf16_as_its_config_does(self):
        f = emit(self.folder("pure"), "--model", "llama-2-7b", "--precision", "bf16-pure", "--cluster", "2xA100-80GB", "--strategy", "zero2")
        s = run_train(f)
        ta, ds = self.assert_matches_ds_config(f, s)
        self.assertTrue(ds["bf16"]["bf16_master_weights_and_grads"])
        self.assertTrue(ta["bf16"])

    def test_pure_bf16_ddp_launches_without_deepspeed(self):
        # DeepSpeed runs pure bf16 under ZeRO only; the Trainer's DDP trains the bf16 model as is.
        f = emit(self.folder("pure-ddp"), "--model", "llama-2-7b", "--precision", "bf16-pure", "--cluster", "2xA100-80GB",
                 "--strategy", "ddp")
        self.assertFalse(os.path.exists(os.path.join(f, "ds_config.json")))
        self.assertIn("mixed_precision: 'no'", read(f, "accelerate_config.yaml").replace('"', "'"))
        s = run_train(f)
        (ta,) = s.named("TrainingArguments")
        self.assertIsNone(ta["deepspeed"])
        self.assertFalse(ta["bf16"])
        self.assertEqual(s.named("from_pretrained")[0]["torch_dtype"], torch.bfloat16)
        # plan.json says the strategy in accelerate's YAML too, and reads back in pure bf16
        r = subprocess.run([PEFTPLAN, "report", "--plan", os.path.join(f, "plan.json"), "--no-recommend", "--out", os.path.join(f, "rep")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertIn("bf16-pure", read(os.path.join(f, "rep"), "report.md"))

    def test_qlora_on_unsharded_parameters_loads_on_each_ranks_gpu(self):
        f = emit(self.folder("qlora-ddp"), "--model", "llama-2-7b", "--quant", "nf4", "--cluster", "2xA100-80GB", "--strategy", "ddp",
                 "--checkpointing", "full")
        s = run_train(f, local_rank="1")
        self.assert_matches_ds_config(f, s)
        (load,) = s.named("from_pretrained")
        self.assertEqual(load["device_map"], {"": 1})
        self.assertEqual(load["quantization_config"].kw["bnb_4bit_quant_type"], "nf4")
        (prep,) = s.named("prepare_model_for_kbit_training")
        self.assertTrue(prep["use_gradient_checkpointing"])
        self.assertEqual(prep["gradient_checkpointing_kwargs"], {"use_reentrant": s.plan["checkpoint_reentrant"]})
        self.assertEqual(s.named("enable_input_require_grads"), [])  # prepare_model_for_kbit_training does it
        (ta,) = s.named("TrainingArguments")
        self.assertTrue(ta["gradient_checkpointing"])
        self.assertEqual(ta["gradient_checkpointing_kwargs"], {"use_reentrant": s.plan["checkpoint_reentrant"]})

    def test_sharded_qlora_loads_on_the_host_without_the_kbit_upcast(self):
        f = emit(self.folder("qlora-fsdp"), "--profile", "hf", "--model", "llama-2-7b", "--quant", "nf4", "--cluster", "2xA100-80GB",
                 "--strategy", "fsdp-full-shard", "--no-offload")
        self.assertFalse(os.path.exists(os.path.join(f, "ds_config.json")))
        s = run_train(f)
        self.assertTrue(s.plan["shards_params"])
        (load,) = s.named("from_pretrained")
        self.assertNotIn("device_map", load)
        self.assertEqual(load["quantization_config"].kw["bnb_4bit_quant_storage"], load["torch_dtype"])
        self.assertEqual(s.named("prepare_model_for_kbit_training"), [])
        (ta,) = s.named("TrainingArguments")
        self.assertIsNone(ta["deepspeed"])
        sh = read(f, "launch.sh")
        self.assertNotIn("torchrun", sh)
        self.assertIn("accelerate launch --config_file accelerate_config.yaml", sh)
        self.assertEqual(subprocess.run(["sh", "-n", os.path.join(f, "launch.sh")]).returncode, 0)

    def test_every_k_checkpointing_wraps_every_kth_layer_and_computes_the_same(self):
        f = emit(self.folder("every2"), "--model", "tiny-llama-4l", "--cluster", "1xA100-80GB", "--precision", "fp32", "--attention", "flash",
                 "--checkpointing", "every-2", "--optimizer", "adamw-8bit", "--cross-entropy", "chunked", "--seq-len", "128")
        s = run_train(f)
        self.assertEqual(s.plan["checkpointing"], "every-2")
        (load,) = s.named("from_pretrained")
        self.assertEqual(load["attn_implementation"], "sdpa")  # flash-attn 2 has no fp32 kernels
        self.assertEqual(load["torch_dtype"], torch.float32)
        (ta,) = s.named("TrainingArguments")
        self.assertFalse(ta["gradient_checkpointing"])  # train.py's own wrapper does it
        self.assertEqual(ta["optim"], "adamw_bnb_8bit")
        self.assertTrue(ta["use_liger_kernel"])
        self.assertFalse(s.model.config.use_cache)
        reentrant = s.plan["checkpoint_reentrant"]
        self.assertEqual(len(s.named("enable_input_require_grads")), 1 if reentrant else 0)
        wrapped = ["forward" in vars(layer) for layer in s.layers]
        self.assertEqual(wrapped, [True, False, True, False])
        # The wrapped layer against the plain one: output and gradients, hidden states positional
        # and the mask by keyword (reentrant checkpointing takes no keyword tensors).
        layer = s.layers[0]
        x = torch.tensor([0.3, -1.2, 0.7], requires_grad=True)
        mask = torch.tensor([0.0, 1.0, -1.0])
        y = layer(x, attention_mask=mask)
        y.sum().backward()
        gx, gw = x.grad.clone(), layer.w.grad.clone()
        x.grad, layer.w.grad = None, None
        plain = Layer.forward(layer, x, attention_mask=mask)
        self.assertTrue(torch.equal(y, plain))
        plain.sum().backward()
        self.assertTrue(torch.allclose(gx, x.grad) and torch.allclose(gw, layer.w.grad))

    def test_a_model_path_with_quotes_and_backslashes_stays_one_string(self):
        odd = os.path.join(self.tmp, 'we"ird\\path \'x')
        os.makedirs(odd)
        shutil.copy(os.path.join(ROOT, "models", "zoo", "tiny-llama-4l.json"), os.path.join(odd, "config.json"))
        f = emit(self.folder("odd"), "--model", odd, "--cluster", "1xA100-80GB")
        s = run_train(f)
        self.assertEqual(s.plan["model"], odd)
        (load,) = s.named("from_pretrained")
        self.assertEqual(load["name"], odd)
        self.assertEqual(s.named("tokenizer")[0]["name"], odd)

    def test_several_machines_launch_without_deepspeeds_ssh_launcher(self):
        f = emit(self.folder("nodes"), "--model", "llama-2-70b", "--lora-r", "16", "--cluster", "2x8xA100-80GB-100GbE", "--gpus", "16",
                 "--strategy", "zero3")
        sh = read(f, "launch.sh")
        self.assertNotIn("deepspeed --num_nodes", sh)
        self.assertIn("torchrun --nnodes 2 --nproc_per_node 8", sh)
        self.assertIn("accelerate launch --config_file accelerate_config.yaml --num_machines 2 --num_processes 16", sh)
        self.assertIn("  deepspeed_multinode_launcher: standard\n", read(f, "accelerate_config.yaml"))
        self.assertEqual(subprocess.run(["sh", "-n", os.path.join(f, "launch.sh")]).returncode, 0)
        one = emit(self.folder("one-node"), "--model", "llama-2-70b", "--lora-r", "16", "--cluster", "8xA100-80GB", "--strategy", "zero3")
        self.assertIn("deepspeed --num_nodes 1 --num_gpus 8", read(one, "launch.sh"))
        self.assertNotIn("multinode", read(one, "accelerate_config.yaml"))

    def test_a_folder_where_a_file_goes_stops_the_emit_before_it_writes(self):
        f = self.folder("blocked")
        os.makedirs(os.path.join(f, "train.py"))
        p = subprocess.run([PEFTPLAN, "recommend", "--model", "tiny-llama-4l", "--cluster", "1xA100-80GB", "--top", "1", "--emit", f],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        self.assertEqual(p.returncode, 2, p.stdout)
        self.assertIn("train.py: is a folder, where a launch file goes (nothing was written)", p.stdout)
        self.assertEqual(os.listdir(f), ["train.py"])

    def test_sgd_under_zero_is_allowed_by_its_config(self):
        f = emit(self.folder("sgd"), "--model", "llama-2-7b", "--optimizer", "sgd", "--cluster", "2xA100-80GB", "--strategy", "zero2")
        ds = json.loads(read(f, "ds_config.json"))
        self.assertEqual(ds["optimizer"]["type"], "SGD")
        self.assertTrue(ds["zero_allow_untested_optimizer"])
        s = run_train(f)
        ta, _ = self.assert_matches_ds_config(f, s)
        self.assertEqual(ta["optim"], "sgd")
        # ds_config.json's optimizer section builds SGD with its momentum under DeepSpeed
        self.assertNotIn("optimizer_cls_and_kwargs", s.named("Trainer")[0])

    def test_sgd_outside_deepspeed_keeps_its_momentum(self):
        # The Trainer's optim="sgd" alone is torch.optim.SGD without momentum; the plan keeps a
        # momentum buffer (the optimizer_states it counts).
        f = emit(self.folder("sgd-ddp"), "--profile", "hf", "--model", "llama-2-7b", "--optimizer", "sgd", "--cluster", "2xA100-80GB",
                 "--strategy", "ddp")
        self.assertFalse(os.path.exists(os.path.join(f, "ds_config.json")))
        s = run_train(f)
        (trainer,) = s.named("Trainer")
        cls, kwargs = trainer["optimizer_cls_and_kwargs"]
        self.assertIs(cls, torch.optim.SGD)
        self.assertEqual(kwargs, {"lr": s.plan["learning_rate"], "momentum": 0.9})
        self.assertEqual(s.named("TrainingArguments")[0]["optim"], "sgd")

    def test_fsdp_activation_checkpointing_turns_the_trainers_off(self):
        # transformers refuses FSDP's activation_checkpointing together with the Trainer's
        # gradient_checkpointing (trainer.py create_accelerator_and_postprocess). A row the search
        # checkpoints itself leaves FSDP's off in the YAML; a row whose config has it on (the
        # explorer's export of an accelerate YAML, test_gui) says so in PLAN.
        f = emit(self.folder("fsdp-ckpt"), "--profile", "hf", "--model", "llama-2-7b", "--cluster", "2xA100-80GB",
                 "--strategy", "fsdp-full-shard", "--checkpointing", "full", "--no-offload")
        self.assertIn("fsdp_activation_checkpointing: false", read(f, "accelerate_config.yaml"))
        s = run_train(f)
        self.assertFalse(s.plan["fsdp_checkpointing"])
        self.assertTrue(s.named("TrainingArguments")[0]["gradient_checkpointing"])
        with open(os.path.join(f, "train.py"), encoding="utf-8") as fh:
            text = fh.read()
        self.assertEqual(text.count('"fsdp_checkpointing": False,'), 1)
        with open(os.path.join(f, "train.py"), "w", encoding="utf-8") as fh:
            fh.write(text.replace('"fsdp_checkpointing": False,', '"fsdp_checkpointing": True,'))
        s = run_train(f)
        (ta,) = s.named("TrainingArguments")
        self.assertFalse(ta["gradient_checkpointing"])
        self.assertNotIn("gradient_checkpointing_kwargs", ta)


if __name__ == "__main__":
    unittest.main()
