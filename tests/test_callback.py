#!/usr/bin/env python3
"""Tests tools/peftplan_callback.py on the CPU: the plain functions in one process, two gloo ranks,
the Trainer callback (against a stand-in transformers module here, the real one when it imports),
and bad arguments. Expected statistics are recomputed independently (statistics.median,
torch.quantile, hashlib); no GPU numbers are checked, since no GPU is assumed.

Run: /usr/bin/python3 tests/test_callback.py                 (exit status non-zero on failure)
     /usr/bin/python3 tests/test_callback.py --write-example PATH
        trains the tiny model 8 steps (tokens per step 4 x 128, config models/zoo/tiny-llama-4l.json)
        and writes its measurement to PATH, for the `peftplan compare` tests.
"""
import argparse
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
import unittest
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODULE_PATH = os.path.join(ROOT, "tools", "peftplan_callback.py")
sys.dont_write_bytecode = True  # no __pycache__ left in the source tree by a ctest run
sys.path.insert(0, os.path.dirname(MODULE_PATH))
import peftplan_callback as pc  # noqa: E402  (after the path is set)

ZOO = os.path.join(ROOT, "models", "zoo", "tiny-llama-4l.json")  # a plain config.json object
B, S, STEPS = 4, 128, 8  # micro-batch, sequence length, optimizer steps
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAVE_TRAINER = HAVE_TRANSFORMERS and importlib.util.find_spec("accelerate") is not None  # Trainer needs both


def zoo_config():
    with open(ZOO, encoding="utf-8") as f:
        return json.load(f)


class TinyLM(torch.nn.Module):
    """Embedding, one SwiGLU-free MLP block, untied head; dimensions from tiny-llama-4l:
    V=256, H=128, intermediate 352: 256*128 + (128*352+352) + (352*128+128) + (128*256+256)
    = 156,384 parameters."""

    def __init__(self, cfg):
        super().__init__()
        V, H, I = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
        self.embed = torch.nn.Embedding(V, H)
        self.up = torch.nn.Linear(H, I)
        self.down = torch.nn.Linear(I, H)
        self.head = torch.nn.Linear(H, V)

    def forward(self, ids):  # ids [B, S] -> logits [B, S, V]
        h = self.embed(ids)
        h = h + self.down(F.silu(self.up(h)))
        return self.head(h)


def train(steps, batch, on_step, seed=0, sleep_s=0.0, model=None):
    """AdamW on random next-token data; on_step() after every optimizer.step(). Returns the model."""
    cfg = zoo_config()
    torch.manual_seed(seed)
    model = model if model is not None else TinyLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, cfg["vocab_size"], (batch, S + 1))
    for _ in range(steps):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sleep_s:
            time.sleep(sleep_s)
        on_step()
    return model


def iqr_reference(xs):
    """q3 - q1 by torch.quantile (linear interpolation, numpy's default), in float64."""
    t = torch.tensor(xs, dtype=torch.float64)
    return (torch.quantile(t, 0.75) - torch.quantile(t, 0.25)).item()


def file_sha256(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=False).encode("utf-8")).hexdigest()


def write_example(path):
    pc.start(tokens_per_step=B * S)
    train(STEPS, B, pc.record_step)
    pc.write_measurement(path, config_path=ZOO)
    print(f"wrote {path}")


def load_module_with_fake_transformers():
    """A fresh copy of the module, loaded while sys.modules["transformers"] is a stand-in whose
    TrainerCallback has transformers' no-op event methods."""
    fake = types.ModuleType("transformers")

    class TrainerCallback:
        def on_train_begin(self, args, state, control, **kwargs):
            pass

        def on_step_end(self, args, state, control, **kwargs):
            pass

        def on_train_end(self, args, state, control, **kwargs):
            pass

        def on_log(self, args, state, control, **kwargs):
            pass

    fake.TrainerCallback = TrainerCallback
    with mock.patch.dict(sys.modules, {"transformers": fake}):
        spec = importlib.util.spec_from_file_location("peftplan_callback_fake", MODULE_PATH)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        cls = mod.PeftplanCallback  # made now, while the stand-in is importable
    return mod, cls, TrainerCallback


class FakeHFConfig:
    """Enough of transformers.PretrainedConfig: name_or_path, to_dict(), attributes."""

    def __init__(self, d, name_or_path):
        self._d = dict(d)
        self.name_or_path = name_or_path

    def to_dict(self):
        return dict(self._d)

    def __getattr__(self, key):
        try:
            return self.__dict__["_d"][key]
        except KeyError:
            raise AttributeError(key) from None


class TmpDirTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="peftplan-callback-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def assert_no_tmp_files(self):
        self.assertEqual(glob.glob(os.path.join(self.dir, "*.tmp.*")), [])


class Statistics(unittest.TestCase):
    def test_percentile_matches_numpy_linear(self):
        # numpy.percentile docs: a = [[10, 7, 4], [3, 2, 1]], np.percentile(a, 50) == 3.5.
        self.assertEqual(pc.percentile([10, 7, 4, 3, 2, 1], 50), 3.5)
        # By hand: [1, 2, 3, 4], q1 at position 3 * 0.25 = 0.75 -> 1.75, q3 at 2.25 -> 3.25.
        self.assertAlmostEqual(pc.percentile([4, 1, 3, 2], 25), 1.75)
        self.assertAlmostEqual(pc.percentile([4, 1, 3, 2], 75), 3.25)
        self.assertAlmostEqual(pc.interquartile_range([4, 1, 3, 2]), 1.5)
        self.assertEqual(pc.interquartile_range([0.5]), 0.0)

    def test_steady_steps(self):
        self.assertEqual(pc.steady_steps([9, 1, 2], 1), [1, 2])
        self.assertEqual(pc.steady_steps([9, 1, 2], 3), [9, 1, 2])  # not more than warm-up: all

    def test_config_sha256_known_value(self):
        # sha256 of the 68 bytes {"a":[1.5,"x"],"b":1,"eps":1e-05,"name":"café","rope_theta":10000.0}
        # (keys sorted, no spaces, é as UTF-8), computed with `printf '%s' '...' | sha256sum`.
        obj = {"rope_theta": 10000.0, "name": "café", "b": 1, "eps": 1e-5, "a": [1.5, "x"]}
        self.assertEqual(pc.config_sha256(obj),
                         "7d9e34b58b1fe4bede78c976e8db83614a334ef425c74c2c440dbec88ee3a3cb")
        self.assertEqual(pc.config_sha256(zoo_config()), file_sha256(zoo_config()))


class PlainFunctions(TmpDirTest):
    def test_one_process_on_cpu(self):
        out = self.path("measurement.json")
        t0 = time.perf_counter()
        pc.start(tokens_per_step=B * S)
        train(STEPS, B, pc.record_step)
        t1 = time.perf_counter()
        returned = pc.write_measurement(out, config_path=ZOO)
        with open(out, encoding="utf-8") as f:
            m = json.load(f)
        self.assertEqual(m, returned)
        self.assert_no_tmp_files()

        self.assertEqual(m["schema"], "peftplan.measurement-totals/1")
        self.assertEqual(m["writer"], "tools/peftplan_callback.py")
        self.assertEqual((m["world_size"], m["warmup_steps"], m["steps"]), (1, 1, STEPS))
        self.assertEqual(m["tokens_per_step"], B * S)
        self.assertEqual(len(m["per_rank"]), 1)
        r = m["per_rank"][0]
        self.assertEqual((r["rank"], r["local_rank"]), (0, 0))
        self.assertEqual(r["device"]["type"], "cpu")

        times = r["step_times_s"]
        self.assertEqual(len(times), STEPS)
        self.assertTrue(all(t > 0 for t in times))
        self.assertLessEqual(sum(times), t1 - t0)  # the first step is timed from start()
        steady = times[1:]
        self.assertEqual(r["steps_after_warmup"], STEPS - 1)
        self.assertEqual(r["step_s"], statistics.median(steady))
        self.assertAlmostEqual(r["step_s_iqr"], iqr_reference(steady), delta=1e-12)
        self.assertAlmostEqual(r["tokens_per_s_per_gpu"], B * S / statistics.median(steady), delta=1e-6)
        self.assertEqual(r["tokens_per_step"], B * S)

        for key in ("max_memory_allocated_bytes", "max_memory_reserved_bytes", "device_memory_used_bytes"):
            self.assertIsNone(r[key], key)
            self.assertIsNone(m["max"][key], key)
            self.assertTrue(any(line.startswith(key + ":") for line in m["unavailable"]), key)
        self.assertIsNone(r["device_memory_used_source"])
        if not torch.cuda.is_available():
            self.assertIn("max_memory_allocated_bytes: no CUDA device (torch.cuda.is_available() is False)",
                          m["unavailable"])

        self.assertEqual(m["max"]["step_s"], r["step_s"])
        self.assertEqual(m["max"]["step_s_iqr"], r["step_s_iqr"])
        self.assertEqual(m["max"]["tokens_per_s_per_gpu"], r["tokens_per_s_per_gpu"])
        self.assertEqual(m["max"]["rank_of_step_s"], 0)

        cfg = zoo_config()
        self.assertEqual(m["model"]["config_source"], "file")
        self.assertEqual(m["model"]["config_sha256"], file_sha256(cfg))
        self.assertEqual(m["model"]["architecture"], {k: cfg[k] for k in pc.ARCHITECTURE_KEYS})
        self.assertEqual(m["versions"]["python"], ".".join(map(str, sys.version_info[:3])))
        self.assertEqual(m["versions"]["torch"], torch.__version__)
        self.assertEqual(list(m["versions"]), ["python", "torch", "transformers", "peft", "accelerate",
                                               "deepspeed", "bitsandbytes", "cuda", "nccl", "pynvml"])

        # write_measurement reset the default recorder (tokens per step kept): nothing recorded now.
        again = pc.write_measurement(self.path("empty.json"), config_path=ZOO)
        self.assertEqual(again["steps"], 0)
        self.assertIsNone(again["per_rank"][0]["step_s"])
        self.assertIsNone(again["max"]["rank_of_step_s"])
        self.assertIn("step_s: no optimizer steps were recorded (record_step was never called)",
                      again["unavailable"])

    def test_first_step_is_timed_from_start(self):
        rec = pc.Recorder()
        time.sleep(0.2)
        rec.start()
        time.sleep(0.05)
        rec.record_step(tokens=10)
        self.assertGreaterEqual(rec.step_times_s[0], 0.05)
        self.assertLess(rec.step_times_s[0], 0.2)

    def test_tokens_from_record_step_and_unknown_tokens(self):
        rec = pc.Recorder()
        for n in (100, 200, 200, 200):
            rec.record_step(tokens=torch.tensor(n))  # e.g. attention_mask.sum()
        m = rec.write_measurement(self.path("m.json"))
        r = m["per_rank"][0]
        self.assertEqual(r["tokens_per_step"], 200)  # the steps after the warm-up one
        self.assertAlmostEqual(r["tokens_per_s_per_gpu"], 200 / r["step_s"])
        self.assertIsNone(m["model"]["config_sha256"])
        self.assertIn("model: no model and no config_path were given (pass model= or config_path=)",
                      m["unavailable"])

        rec = pc.Recorder()
        rec.record_step()
        rec.record_step()
        m = rec.write_measurement(self.path("m.json"), warmup_steps=5)
        r = m["per_rank"][0]
        self.assertEqual(r["steps_after_warmup"], 2)  # not more steps than warm-up: all of them
        self.assertIsNone(r["tokens_per_s_per_gpu"])
        self.assertIsNone(m["tokens_per_step"])
        self.assertTrue(any(line.startswith("tokens_per_s_per_gpu: the tokens each step processed were not given")
                            for line in m["unavailable"]))

    def test_model_config_found_from_the_model(self):
        cfg = zoo_config()
        folder = self.path("checkpoint")
        os.mkdir(folder)
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=7)  # layout differs from the zoo file: same hash
        model = TinyLM(cfg)
        model.config = FakeHFConfig(cfg, folder)
        peft_like = types.SimpleNamespace(get_base_model=lambda: model)

        rec = pc.Recorder(tokens_per_step=1)
        rec.record_step()
        m = rec.write_measurement(self.path("m.json"), model=peft_like)
        self.assertEqual(m["model"]["config_source"], "file")
        self.assertEqual(m["model"]["config_sha256"], file_sha256(cfg))

        # No config.json where the model came from: model.config.to_dict(), with its extra keys.
        extra = dict(cfg, transformers_version="4.99.0")
        del extra["num_key_value_heads"]
        model.config = FakeHFConfig(extra, "some-org/not-downloaded")
        rec.record_step()
        m = rec.write_measurement(self.path("m.json"), model=types.SimpleNamespace(module=model))
        self.assertEqual(m["model"]["config_source"], "config.to_dict")
        self.assertEqual(m["model"]["config_sha256"], file_sha256(extra))
        arch = m["model"]["architecture"]
        self.assertEqual(arch["num_key_value_heads"], cfg["num_attention_heads"])  # the MHA default

    def test_write_is_atomic(self):
        out = self.path("m.json")
        with open(out, "w", encoding="utf-8") as f:
            f.write("old")
        rec = pc.Recorder()
        rec.record_step()
        with mock.patch.object(pc.os, "replace", side_effect=OSError("disk full")):
            with self.assertRaises(OSError):
                rec.write_measurement(out)
        with open(out, encoding="utf-8") as f:
            self.assertEqual(f.read(), "old")
        self.assert_no_tmp_files()
        rec.write_measurement(out)  # the record was kept: the retry writes it
        with open(out, encoding="utf-8") as f:
            self.assertEqual(json.load(f)["steps"], 1)
        self.assert_no_tmp_files()


class BadArguments(TmpDirTest):
    def test_negative_warmup(self):
        with self.assertRaisesRegex(ValueError, "warmup_steps must be a non-negative integer, got -1"):
            pc.Recorder().write_measurement(self.path("m.json"), warmup_steps=-1)
        with self.assertRaisesRegex(ValueError, "warmup_steps"):
            pc.write_measurement(self.path("m.json"), warmup_steps=-1)

    def test_path_in_a_missing_folder(self):
        path = os.path.join(self.dir, "no-such-folder", "m.json")
        with self.assertRaises(ValueError) as e:
            pc.Recorder().write_measurement(path)
        self.assertIn(path, str(e.exception))
        self.assertIn("does not exist", str(e.exception))

    def test_other_bad_values(self):
        rec = pc.Recorder()
        with self.assertRaisesRegex(ValueError, "tokens must be a non-negative whole number"):
            rec.record_step(tokens=-5)
        with self.assertRaisesRegex(ValueError, "tokens_per_step"):
            pc.Recorder(tokens_per_step=2.5)
        missing = self.path("missing.json")
        with self.assertRaisesRegex(ValueError, "config_path"):
            rec.write_measurement(self.path("m.json"), config_path=missing)
        with self.assertRaisesRegex(ValueError, "warmup_steps"):
            pc._CallbackLogic(warmup_steps=-1)
        with self.assertRaisesRegex(ValueError, "seq_len must be a positive integer"):
            pc._CallbackLogic(seq_len=0)
        with self.assertRaisesRegex(ValueError, "config_path"):
            pc._CallbackLogic(config_path=missing)


def _rank_main(rank, world, init_file, out_path):
    """One gloo rank: rank r trains B / (r + 1) sequences a step; rank 1 also sleeps 50 ms a step,
    so it is the slowest rank."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    try:
        batch = B // (rank + 1)
        pc.start(tokens_per_step=batch * S)
        train(STEPS, batch, pc.record_step, seed=rank, sleep_s=0.05 if rank == 1 else 0.0)
        returned = pc.write_measurement(out_path, config_path=ZOO)
        assert (returned is None) == (rank != 0), returned
    finally:
        dist.destroy_process_group()


class TwoRanks(TmpDirTest):
    def test_gloo_two_ranks(self):
        out = self.path("m.json")
        mp.start_processes(_rank_main, args=(2, self.path("init"), out), nprocs=2, join=True,
                           start_method="spawn")
        with open(out, encoding="utf-8") as f:
            m = json.load(f)
        self.assertEqual([n for n in os.listdir(self.dir) if n != "init"], ["m.json"])  # rank 1 wrote nothing

        self.assertEqual((m["world_size"], m["steps"]), (2, STEPS))
        per_rank = m["per_rank"]
        self.assertEqual([r["rank"] for r in per_rank], [0, 1])
        self.assertEqual([r["local_rank"] for r in per_rank], [0, 1])
        self.assertEqual(m["tokens_per_step"], B * S + B // 2 * S)
        for r in per_rank:
            self.assertEqual(len(r["step_times_s"]), STEPS)
            self.assertEqual(r["step_s"], statistics.median(r["step_times_s"][1:]))
        slow = max(per_rank, key=lambda r: r["step_s"])
        self.assertEqual(slow["rank"], 1)
        self.assertGreaterEqual(slow["step_s"], 0.05)
        self.assertEqual(m["max"]["rank_of_step_s"], 1)
        self.assertEqual(m["max"]["step_s"], slow["step_s"])
        self.assertEqual(m["max"]["step_s_iqr"], slow["step_s_iqr"])
        self.assertEqual(m["max"]["tokens_per_s_per_gpu"], min(r["tokens_per_s_per_gpu"] for r in per_rank))
        self.assertEqual(m["model"]["config_sha256"], file_sha256(zoo_config()))
        # Both ranks on the CPU: one line for the field, not one per rank.
        self.assertEqual(sum(line.startswith("max_memory_allocated_bytes") for line in m["unavailable"]), 1)


class Callback(TmpDirTest):
    def test_with_a_stand_in_transformers(self):
        mod, cls, base = load_module_with_fake_transformers()
        self.assertTrue(issubclass(cls, base))
        out = self.path("m.json")
        cb = cls(path=out, seq_len=16, config_path=ZOO)
        args = types.SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=3)
        cb.on_train_begin(args, None, None)
        model = train(4, 2, lambda: cb.on_step_end(args, None, None))
        cb.on_log(args, None, None)  # events it does not handle fall through to TrainerCallback
        cb.on_train_end(args, None, None, model=model)
        with open(out, encoding="utf-8") as f:
            m = json.load(f)
        self.assertEqual(m["steps"], 4)
        self.assertEqual(m["tokens_per_step"], 2 * 3 * 16)
        self.assertEqual(m["model"]["config_sha256"], file_sha256(zoo_config()))
        self.assert_no_tmp_files()

        cb = cls(path=self.path("n.json"))  # no seq_len: tokens/s unknown, and said why
        cb.on_train_begin(args, None, None)
        cb.on_step_end(args, None, None)
        cb.on_step_end(args, None, None)
        cb.on_train_end(args, None, None, model=model)
        with open(self.path("n.json"), encoding="utf-8") as f:
            m = json.load(f)
        self.assertIsNone(m["per_rank"][0]["tokens_per_s_per_gpu"])
        self.assertTrue(any("pass tokens_per_step=... or seq_len=... to PeftplanCallback" in line
                            for line in m["unavailable"]))
        self.assertTrue(any(line.startswith("model: the model has no transformers config")
                            for line in m["unavailable"]))

    @unittest.skipIf(HAVE_TRANSFORMERS, "transformers is installed")
    def test_without_transformers_construction_raises(self):
        with self.assertRaisesRegex(ImportError, "PeftplanCallback needs transformers"):
            pc.PeftplanCallback()

    @unittest.skipUnless(HAVE_TRAINER, "transformers or accelerate is not installed: the real Trainer is not tested")
    def test_real_trainer(self):
        import transformers
        cfg = transformers.LlamaConfig(**{k: v for k, v in zoo_config().items()
                                         if k not in ("architectures", "torch_dtype")})
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (8, 16))
        data = [{"input_ids": row, "labels": row} for row in ids]
        out = self.path("m.json")
        args = transformers.TrainingArguments(output_dir=self.path("trainer"), max_steps=4,
                                              per_device_train_batch_size=2, gradient_accumulation_steps=1,
                                              report_to="none", save_strategy="no", disable_tqdm=True)
        callback = pc.PeftplanCallback(path=out, seq_len=16, config_path=ZOO)
        self.assertIsInstance(callback, transformers.TrainerCallback)
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
        with open(out, encoding="utf-8") as f:
            m = json.load(f)
        self.assertEqual(m["steps"], 4)
        self.assertEqual(m["tokens_per_step"], 2 * 16 * max(1, args.world_size))
        self.assertEqual(m["model"]["architecture"]["hidden_size"], 128)
        self.assertEqual(m["versions"]["transformers"], transformers.__version__)


if __name__ == "__main__":
    if "--write-example" in sys.argv:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--write-example", metavar="PATH", required=True,
                            help="write the tiny model's measurement to PATH and exit")
        write_example(parser.parse_args().write_example)
        sys.exit(0)
    unittest.main()
