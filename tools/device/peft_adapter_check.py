#!/usr/bin/env python3
"""Does PEFT load the adapter our executor trains, and compute what our executor computes with it?
(the last check of scripts/device-check.sh; issue 17: "loads the adapter our executor saved with
PEFT's PeftModel.from_pretrained on the same base weights and checks the logits against ours").

What it does, all in OUT:
  1. base/: a Llama of the zoo (--model, default tinyllama-1.1b) built by transformers from the
     zoo's config.json with random weights (--seed), fp32, saved with save_pretrained
     (model.safetensors, Hugging Face names);
  2. train.u32 and eval.u32: random token ids (u32, little-endian), the eval file disjoint;
  3. `peftplan run` trains a LoRA adapter on the base (--weights base/model.safetensors) for
     --steps steps on train.u32 and saves it (--save-adapter adapter/: adapter_model.safetensors
     and adapter_config.json, PEFT's format), dropout 0 so that nothing random is left;
  4. `peftplan run` once more, one step on eval.u32 starting from that adapter (--adapter-init):
     the step's loss is computed before its update, so it is the loss of base + adapter on the
     first micro-batch of eval.u32 (executor/include/peftplan/executor/data.h: sequence i is
     tokens[i·S … i·S+S], position t predicts t+1, the mean over B·S targets);
  5. transformers + PEFT: AutoModelForCausalLM.from_pretrained(base/) and
     PeftModel.from_pretrained(model, adapter/), eval mode, the same B sequences as input_ids and
     labels (transformers shifts them: the same B·S targets), eager attention, TF32 off; the loss
     with the adapter and, under disable_adapter(), without it.
The check passes when PEFT's loss with the adapter is ours within --tolerance (relative; default
1e-4: both sides compute in fp32, the two summation orders differing by a few ulp per dot product
of up to 5,632 terms across 22 layers), and the adapter moves PEFT's loss by more than ten times
that (else a wrongly loaded adapter could pass unseen). A batch's loss is a function of every
logit of it; the logits themselves are not compared (our executor does not write them).
Writes OUT/peft-check.json and prints the figures. Exit 0 on a pass, 1 on a mismatch, 2 when a
prerequisite is missing (torch, transformers, peft, the peftplan binary) or a step fails.

Run:   python3 tools/device/peft_adapter_check.py --out DIR [--model tinyllama-1.1b] [--device cuda]
       (PEFTPLAN_BACKEND=cuda makes `peftplan run` train on the GPU; default: the CPU executor)
tests/test_peft_check.py runs it on the CPU with stand-ins for transformers and peft.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ZOO = os.path.join(ROOT, "models", "zoo")
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="PEFT loads our executor's adapter and computes our loss with it")
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--model", default="tinyllama-1.1b", help="a Llama of the zoo (models/zoo/<name>.json)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--steps", type=int, default=6, help="training steps of the adapter (default 6)")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate (default 1e-2: the adapter must move the loss)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-targets", default=DEFAULT_TARGETS)
    p.add_argument("--seed", type=int, default=0, help="seed of the base weights and the tokens")
    p.add_argument("--device", default="cuda", help="where transformers computes (cuda, cpu; default cuda)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="relative loss tolerance (default 1e-4)")
    p.add_argument("--cluster", default=None,
                   help="`peftplan run --cluster` (its predictions are not this check's concern; default: the calibrated profile)")
    p.add_argument("--peftplan", default=os.environ.get("PEFTPLAN") or os.path.join(ROOT, "build", "release", "cli", "peftplan"),
                   help="the peftplan binary (default $PEFTPLAN, else build/release/cli/peftplan)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    ns = p.parse_args(argv)
    for name in ("micro_batch", "seq_len", "steps", "lora_r"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(ns, name)}")
    if not ns.lr > 0 or not ns.tolerance > 0 or not ns.lora_alpha > 0:
        p.error("--lr, --lora-alpha and --tolerance must be positive")
    return ns


def zoo_config(model: str) -> Dict[str, Any]:
    path = os.path.join(ZOO, model + ".json")
    if not os.path.isfile(path):
        raise SystemExit(f"peft_adapter_check: --model {model}: no {path}")
    with open(path) as f:
        config = json.load(f)
    if config.get("model_type") != "llama":
        raise SystemExit(f"peft_adapter_check: --model {model}: model_type {config.get('model_type')!r}, this check builds Llamas")
    return config


def write_tokens(path: str, n: int, vocab: int, seed: int) -> List[int]:
    """n random token ids below vocab, u32 little-endian (peftplan run --data-format u32)."""
    import random
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab) for _ in range(n)]
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{n}I", *tokens))
    return tokens


def sequences(tokens: Sequence[int], seq_len: int, count: int) -> List[List[int]]:
    """The executor's sequences 0..count-1 (data.h): sequence i is tokens[i·S + j mod n], j = 0..S."""
    n = len(tokens)
    return [[tokens[(i * seq_len + j) % n] for j in range(seq_len + 1)] for i in range(count)]


def run_args(ns: argparse.Namespace, config: str, weights: str, data: str, out: str, steps: int,
             adapter_flag: List[str]) -> List[str]:
    """The `peftplan run` line of a step: one GPU (rank), DDP, no LoRA dropout, one round."""
    return [ns.peftplan, "run", "--model", config, "--weights", weights, "--data", data, "--data-format", "u32",
            "--gpus", "1", "--strategy", "ddp", "--lora-r", str(ns.lora_r), "--lora-alpha", f"{ns.lora_alpha:g}",
            "--lora-targets", ns.lora_targets, "--lora-dropout", "0", "--micro-batch", str(ns.micro_batch),
            "--seq-len", str(ns.seq_len), "--steps", str(steps), "--lr", f"{ns.lr:g}", "--rounds", "1",
            "--out", out] + (["--cluster", ns.cluster] if ns.cluster else []) + adapter_flag


def run_peftplan(args: List[str], log: str) -> None:
    """Runs `peftplan run`; its exit code 1 (a prediction outside its tolerance) is not this check's
    concern, anything else is a failed step."""
    with open(log, "w") as f:
        rc = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc not in (0, 1):
        tail = open(log).read()[-2000:]
        raise RuntimeError(f"{' '.join(args[:2])} exited {rc} (log {log}):\n{tail}")


def first_loss(run_dir: str) -> float:
    with open(os.path.join(run_dir, "measurement.json")) as f:
        return float(json.load(f)["losses"][0])


def dtype_keyword(transformers_version: str) -> str:
    """transformers 5 names the model's dtype `dtype`; 4.x `torch_dtype`."""
    try:
        return "dtype" if int(transformers_version.split(".")[0]) >= 5 else "torch_dtype"
    except ValueError:
        return "torch_dtype"


def build_base(config: Dict[str, Any], out_dir: str, seed: int, device: str) -> None:
    """The base model from the zoo config, random weights, fp32, saved in Hugging Face's format
    (initialised on the GPU when there is one: seconds instead of a minute of CPU normal_())."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    transformers.set_seed(seed)
    cfg = AutoConfig.from_pretrained(out_dir)
    kw = {dtype_keyword(transformers.__version__): torch.float32, "attn_implementation": "eager"}
    if device.startswith("cuda"):
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, **kw)
    else:
        model = AutoModelForCausalLM.from_config(cfg, **kw)
    model.save_pretrained(out_dir, safe_serialization=True)


def peft_losses(base_dir: str, adapter_dir: str, seqs: List[List[int]], device: str) -> Dict[str, float]:
    """PEFT's loss of the batch with the adapter and without it (disable_adapter)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from peft import PeftModel

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products, as our executor's cuBLAS calls
        torch.backends.cudnn.allow_tf32 = False
    kw = {dtype_keyword(transformers.__version__): torch.float32, "attn_implementation": "eager"}
    model = AutoModelForCausalLM.from_pretrained(base_dir, **kw)
    model = PeftModel.from_pretrained(model, adapter_dir).to(device).eval()
    ids = torch.tensor(seqs, dtype=torch.long, device=device)
    with torch.no_grad():
        with_adapter = float(model(input_ids=ids, labels=ids).loss)
        with model.disable_adapter():
            without = float(model(input_ids=ids, labels=ids).loss)
    return {"with_adapter": with_adapter, "without_adapter": without}


def verdict(ours: float, peft: float, base: float, tolerance: float) -> Dict[str, Any]:
    """Passes when PEFT's loss is ours within the tolerance and the adapter moved it by more than
    ten times that."""
    error = (peft - ours) / abs(ours)
    moved = (peft - base) / abs(base)
    agree = abs(error) <= tolerance
    visible = abs(moved) > 10 * tolerance
    why = []
    if not agree:
        why.append(f"PEFT's loss {peft:.7f} is {error:+.2e} from ours {ours:.7f} (tolerance {tolerance:g})")
    if not visible:
        why.append(f"the adapter moves PEFT's loss by {moved:+.2e} only (at most ten times the tolerance): "
                   "train longer or with a larger --lr")
    return {"ours": ours, "peft": peft, "peft_without_adapter": base, "relative_error": error,
            "adapter_effect": moved, "tolerance": tolerance, "pass": agree and visible, "why": why}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse_args(argv)
    if not (os.path.isfile(ns.peftplan) and os.access(ns.peftplan, os.X_OK)):
        print(f"peft_adapter_check: no peftplan at {ns.peftplan} (--peftplan or PEFTPLAN)", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import peft  # noqa: F401
    except ImportError as e:
        print(f"peft_adapter_check: {e.name} is not installed: this check needs torch, transformers and peft", file=sys.stderr)
        return 2
    out = os.path.abspath(ns.out)
    os.makedirs(out, exist_ok=True)
    config = zoo_config(ns.model)
    base = os.path.join(out, "base")
    adapter = os.path.join(out, "adapter")
    B, S = ns.micro_batch, ns.seq_len
    try:
        build_base(config, base, ns.seed, ns.device)
        weights = os.path.join(base, "model.safetensors")
        if not os.path.isfile(weights):
            raise RuntimeError(f"save_pretrained wrote no {weights}")
        vocab = int(config["vocab_size"])
        write_tokens(os.path.join(out, "train.u32"), ns.steps * B * S + 1, vocab, ns.seed + 1)
        eval_tokens = write_tokens(os.path.join(out, "eval.u32"), B * S + 1, vocab, ns.seed + 2)
        cfg_path = os.path.join(base, "config.json")
        run_peftplan(run_args(ns, cfg_path, weights, os.path.join(out, "train.u32"), os.path.join(out, "train"), ns.steps,
                              ["--save-adapter", adapter]), os.path.join(out, "train.log"))
        run_peftplan(run_args(ns, cfg_path, weights, os.path.join(out, "eval.u32"), os.path.join(out, "eval"), 1,
                              ["--adapter-init", os.path.join(adapter, "adapter_model.safetensors")]), os.path.join(out, "eval.log"))
        ours = first_loss(os.path.join(out, "eval"))
        losses = peft_losses(base, adapter, sequences(eval_tokens, S, B), ns.device)
    except (RuntimeError, OSError, KeyError, ValueError) as e:
        print(f"peft_adapter_check: {e}", file=sys.stderr)
        return 2
    v = verdict(ours, losses["with_adapter"], losses["without_adapter"], ns.tolerance)
    v.update({"model": ns.model, "micro_batch": B, "seq_len": S, "steps": ns.steps, "lr": ns.lr,
              "lora": {"r": ns.lora_r, "alpha": ns.lora_alpha, "targets": ns.lora_targets.split(",")}})
    with open(os.path.join(out, "peft-check.json"), "w") as f:
        json.dump(v, f, indent=2)
    print(f"{ns.model}, LoRA r {ns.lora_r} on {ns.lora_targets}, trained {ns.steps} steps by peftplan, B {B} x S {S}:")
    print(f"  loss with the adapter: ours {v['ours']:.7f}, PEFT {v['peft']:.7f} ({v['relative_error']:+.2e}, tolerance {ns.tolerance:g})")
    print(f"  PEFT without the adapter {v['peft_without_adapter']:.7f} (the adapter moves it {v['adapter_effect']:+.2e})")
    print("  PASS" if v["pass"] else "  FAIL: " + "; ".join(v["why"]))
    return 0 if v["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
