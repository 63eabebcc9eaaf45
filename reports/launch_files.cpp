// The launch files of a configuration (see launch_files.h).
#include "peftplan/reports/launch_files.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "peftplan/common/atomic_file.h"
#include "peftplan/common/error.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/accelerate_config.h"
#include "peftplan/planner/ds_config.h"
#include "peftplan/planner/launcher_config.h"
#include "peftplan/planner/plan_file.h"

namespace peftplan::reports {
namespace {

void replace_all(std::string& s, std::string_view key, std::string_view value) {
  for (std::size_t at = s.find(key); at != std::string::npos; at = s.find(key, at + value.size())) s.replace(at, key.size(), value);
}

std::string py_bool(bool b) { return b ? "True" : "False"; }

// The Hugging Face id (zoo) or the path the user gave: what from_pretrained loads.
std::string model_id_for(const std::string& model_arg) {
  for (const auto& z : models::zoo())
    if (z.name == model_arg) return z.hf_id.empty() ? model_arg : z.hf_id;
  std::filesystem::path p(model_arg);
  if (p.filename() == "config.json") p = p.parent_path();
  return p.string();
}

// The train.py template: @NAME@ fields are filled in by train_py().
constexpr std::string_view kTrainPy = R"PY(#!/usr/bin/env python3
"""Fine-tunes @MODEL_DOC@ as peftplan planned it: @FAMILY@, micro-batch @MB@ x
accumulation @ACCUM@ per GPU on @GPUS@ GPU(s), checkpointing @CKPT@, @SEQ@-token sequences,
precision @PRECISION@ (profile @PROFILE@).

Launch it with a line of launch.sh. The data is a text file (--data FILE) or a Hugging Face
dataset with a "text" column (--dataset NAME); it is tokenised, concatenated and cut into
@SEQ@-token sequences, the shape the plan assumes. With peftplan_callback.py (tools/ in the
peftplan tree) beside this file, rank 0 writes peftplan-measurement.json for
`peftplan compare plan.json peftplan-measurement.json`.
"""
import argparse
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator

HERE = os.path.dirname(os.path.abspath(__file__))

# What the plan fixed. Change it here and re-plan: plan.json and the launcher's config say the same.
PLAN = {
    "model": @MODEL_ID@,
    "seq_len": @SEQ@,
    "micro_batch": @MB@,
    "grad_accum": @ACCUM@,
    "precision": "@PRECISION@",
    "checkpointing": "@CKPT@",
    "checkpoint_reentrant": @REENTRANT@,
    "fsdp_checkpointing": @FSDP_CKPT@,  # accelerate_config.yaml's fsdp_activation_checkpointing does it
    "attention": "@ATTN@",
    "cross_entropy": "@CE@",
    "optimizer": "@OPTIM@",
    "deepspeed": @DS@,
    "quantization": @QUANT@,
    "full_finetune": @FULL@,
    "shards_params": @SHARDS@,
    "learning_rate": @LR@,
    "weight_decay": @WD@,
    "adam_betas": (@BETA1@, @BETA2@),
    "adam_eps": @EPS@,
    "sgd_momentum": @MOMENTUM@,
    "grad_clip": @CLIP@,
}


def packed_dataset(tokenizer, args):
    """Token ids cut into seq_len blocks (labels = inputs: the Trainer's causal-LM loss shifts them)."""
    from datasets import Dataset, load_dataset
    if args.data:
        with open(args.data, encoding="utf-8") as f:
            texts = [f.read()]
    else:
        texts = [row["text"] for row in load_dataset(args.dataset, split=args.split)]
    ids = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    n = PLAN["seq_len"]
    blocks = [ids[i:i + n] for i in range(0, len(ids) - n + 1, n)]
    if not blocks:
        sys.exit(f"train.py: the data has {len(ids)} tokens, fewer than one {n}-token sequence")
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def dtype_of(precision):
    return {"fp32": torch.float32, "fp16": torch.float16}.get(precision, torch.bfloat16)


def attn_implementation():
    """The plan's attention as transformers names it. flash-attn 2 runs fp16 and bf16 only
    (Dao-AILab/flash-attention README), so an fp32 plan's fused attention is PyTorch's SDPA, whose
    memory-efficient kernel keeps no S x S scores either."""
    if PLAN["attention"] != "flash":
        return "eager"
    return "sdpa" if PLAN["precision"] == "fp32" else "flash_attention_2"


def checkpoint_every(model, k, reentrant):
    """Checkpoints decoder layers 0, k, 2k, ... (what the plan's every-k means); the Trainer's
    gradient_checkpointing can only do all of them. The keyword arguments are bound first, as
    transformers' GradientCheckpointingLayer does: reentrant checkpointing takes positional
    tensors only."""
    import functools
    from torch.utils.checkpoint import checkpoint
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    for i, layer in enumerate(layers):
        if i % k:
            continue
        forward = layer.forward

        def wrapped(*a, _forward=forward, **kw):
            if not torch.is_grad_enabled():
                return _forward(*a, **kw)
            return checkpoint(functools.partial(_forward, **kw), *a, use_reentrant=reentrant)
        layer.forward = wrapped


def training_arguments(args):
    """The Trainer's arguments, equal to what ds_config.json says where both say it: transformers
    checks each ds_config value against its argument (integrations/deepspeed.py,
    trainer_config_process: gradient_clipping against max_grad_norm, bf16.enabled against bf16,
    the optimizer's lr, betas, eps and weight_decay) and refuses a mismatch."""
    bf16 = PLAN["precision"] == "bf16" or (PLAN["precision"] == "bf16-pure" and bool(PLAN["deepspeed"]))
    # FSDP's checkpoint_wrapper, when accelerate's config asks for it, in place of the Trainer's
    # (which refuses the two together: trainer.py create_accelerator_and_postprocess)
    full = PLAN["checkpointing"] == "full" and not PLAN["fsdp_checkpointing"]
    extra = {}
    if full:
        extra["gradient_checkpointing_kwargs"] = {"use_reentrant": PLAN["checkpoint_reentrant"]}
    if PLAN["cross_entropy"] == "chunked":
        extra["use_liger_kernel"] = True  # Liger's fused linear cross-entropy: the logits in chunks
    return TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=PLAN["micro_batch"],
        gradient_accumulation_steps=PLAN["grad_accum"],
        max_steps=args.max_steps,
        learning_rate=PLAN["learning_rate"],
        weight_decay=PLAN["weight_decay"],
        adam_beta1=PLAN["adam_betas"][0],
        adam_beta2=PLAN["adam_betas"][1],
        adam_epsilon=PLAN["adam_eps"],
        max_grad_norm=PLAN["grad_clip"],  # 0: no clipping, as the plan's
        # a PeftModel is no PreTrainedModel, so the Trainer would ask DDP to find unused
        # parameters, which reentrant checkpointing breaks ("mark a variable ready only once")
        ddp_find_unused_parameters=False,
        optim={"adamw": "adamw_torch", "adamw-8bit": "adamw_bnb_8bit", "sgd": "sgd"}[PLAN["optimizer"]],
        bf16=bf16,
        fp16=PLAN["precision"] == "fp16",
        gradient_checkpointing=full,
        deepspeed=os.path.join(HERE, PLAN["deepspeed"]) if PLAN["deepspeed"] else None,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        **extra,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a UTF-8 text file to train on")
    src.add_argument("--dataset", help="a Hugging Face dataset with a text column")
    ap.add_argument("--split", default="train")
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--output-dir", default=os.path.join(HERE, "output"))
    ap.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = ap.parse_args()

    # The arguments before the model: they set up the distributed state, and with ZeRO-3 in
    # ds_config.json from_pretrained then builds the model partitioned across the ranks
    # (deepspeed.zero.Init: transformers' is_deepspeed_zero3_enabled reads the config the
    # arguments registered), as FSDP's cpu_ram_efficient_loading needs them first too.
    targs = training_arguments(args)
    tokenizer = AutoTokenizer.from_pretrained(PLAN["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    load = {"torch_dtype": dtype_of(PLAN["precision"]), "attn_implementation": attn_implementation()}
    if PLAN["quantization"] and not PLAN["shards_params"]:
        # each rank's quantised copy on its own GPU (bitsandbytes quantises as it loads onto the
        # device; without a map every rank would load onto cuda:0). A sharded run loads on the
        # host and FSDP or ZeRO-3 places the shards (PEFT's FSDP and DeepSpeed QLoRA guides).
        load["device_map"] = {"": int(os.environ.get("LOCAL_RANK", max(args.local_rank, 0)))}
    if PLAN["quantization"]:
        from transformers import BitsAndBytesConfig
        q = PLAN["quantization"]
        if q["quant_type"] == "int8":
            load["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        else:
            load["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type=q["quant_type"], bnb_4bit_use_double_quant=q["double_quant"],
                bnb_4bit_compute_dtype=dtype_of(PLAN["precision"]), bnb_4bit_quant_storage=dtype_of(PLAN["precision"]))
    model = AutoModelForCausalLM.from_pretrained(PLAN["model"], **load)
    model.config.use_cache = False  # training keeps no key/value cache (the Trainer's checkpointing sets it too)
    full = PLAN["checkpointing"] == "full" and not PLAN["fsdp_checkpointing"]  # FSDP's wrapper does it otherwise
    checkpointed = PLAN["checkpointing"] != "none"
    kbit_prepared = False
    if PLAN["quantization"] and not PLAN["shards_params"]:
        # Its fp32 upcast of the non-quantised weights would make shards of mixed dtypes, which
        # FSDP cannot flatten; sharded QLoRA skips it (TRL's SFTTrainer does the same).
        from peft import prepare_model_for_kbit_training
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=full,
                                                gradient_checkpointing_kwargs={"use_reentrant": PLAN["checkpoint_reentrant"]})
        kbit_prepared = True
    if not PLAN["full_finetune"]:
        from peft import PeftConfig, get_peft_model
        if checkpointed and PLAN["checkpoint_reentrant"] and not (kbit_prepared and full):
            model.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad
        model = get_peft_model(model, PeftConfig.from_pretrained(HERE))  # adapter_config.json here
        model.print_trainable_parameters()
    if PLAN["checkpointing"].startswith("every-"):
        checkpoint_every(model, int(PLAN["checkpointing"][len("every-"):]), PLAN["checkpoint_reentrant"])

    callbacks = []
    sys.path.insert(0, HERE)
    try:
        from peftplan_callback import PeftplanCallback
        callbacks.append(PeftplanCallback(path=os.path.join(HERE, "peftplan-measurement.json"), seq_len=PLAN["seq_len"]))
    except ImportError:
        print("train.py: peftplan_callback.py is not beside train.py; no measurement is written", file=sys.stderr)

    extra = {}
    if PLAN["optimizer"] == "sgd" and not PLAN["deepspeed"]:
        # The Trainer's optim="sgd" is torch.optim.SGD with the learning rate alone, no momentum
        # (trainer.py get_optimizer_cls_and_kwargs); the plan's SGD keeps a momentum buffer.
        # (Under DeepSpeed, ds_config.json's optimizer section builds it with its momentum.)
        extra["optimizer_cls_and_kwargs"] = (torch.optim.SGD, {"lr": PLAN["learning_rate"], "momentum": PLAN["sgd_momentum"]})
    trainer = Trainer(model=model, args=targs, train_dataset=packed_dataset(tokenizer, args),
                      data_collator=default_data_collator, callbacks=callbacks, **extra)
    trainer.train()


if __name__ == "__main__":
    main()
)PY";

// The executor's closest strategy to the row's (it runs DDP and ZeRO; FSDP's placements map to
// the ZeRO stage that shards the same states).
planner::Stage twin_stage(planner::Stage s) {
  using planner::Stage;
  switch (s) {
    case Stage::fsdp_full_shard: case Stage::fsdp_hybrid_shard: return Stage::zero3;
    case Stage::fsdp_shard_grad_op: return Stage::zero2;
    case Stage::fsdp_no_shard: return Stage::ddp;
    default: return s;
  }
}

std::string twin_line(const planner::Candidate& row) {
  const auto& in = row.input;
  const auto& t = in.training;
  const auto& s = in.strategy;
  std::string line = fmt::format("peftplan run --model tiny-llama-4l --strategy {} --gpus {} --micro-batch {} --grad-accum {} --seq-len 128 --checkpointing {}",
                                 name_of(twin_stage(s.stage)), std::min(s.ranks, 4), t.micro_batch, t.grad_accum,
                                 planner::name_of(planner::CheckpointChoice{t.checkpointing, t.checkpoint_every}));
  if (!in.peft.adapters.empty() && in.peft.adapters[0].type == models::PeftType::lora) {
    const auto& l = in.peft.adapters[0].lora;
    line += fmt::format(" --lora-r {} --lora-alpha {:g}", l.r, l.alpha);
    if (l.targets.kind == models::ModuleSelector::Kind::list) line += fmt::format(" --lora-targets {}", fmt::join(l.targets.names, ","));
    else if (l.targets.kind == models::ModuleSelector::Kind::all_linear) line += " --lora-targets all-linear";
  }
  if (s.offload_optimizer == planner::OffloadDevice::cpu || (planner::is_fsdp(s.stage) && s.offload_param == planner::OffloadDevice::cpu))
    line += " --offload-optimizer cpu";
  if (s.offload_param == planner::OffloadDevice::cpu) line += " --offload-param cpu";
  return line;
}

}  // namespace

std::string train_py(const planner::Candidate& row, const std::string& model_id, bool deepspeed) {
  const auto& in = row.input;
  const auto& t = in.training;
  std::string s(kTrainPy);
  const std::string precision = t.precision == planner::Precision::fp16_mixed ? "fp16" : std::string(name_of(t.precision));
  std::string quant = "None";
  if (in.peft.quantization)
    quant = fmt::format("{{\"quant_type\": \"{}\", \"double_quant\": {}}}", name_of(in.peft.quantization->dtype), py_bool(in.peft.quantization->double_quant));
  replace_all(s, "@FAMILY@", row.family);
  replace_all(s, "@MB@", std::to_string(t.micro_batch));
  replace_all(s, "@ACCUM@", std::to_string(t.grad_accum));
  replace_all(s, "@GPUS@", std::to_string(in.strategy.ranks));
  replace_all(s, "@CKPT@", planner::name_of(planner::CheckpointChoice{t.checkpointing, t.checkpoint_every}));
  replace_all(s, "@SEQ@", std::to_string(t.seq_len));
  replace_all(s, "@PRECISION@", precision);
  replace_all(s, "@PROFILE@", name_of(in.profile));
  replace_all(s, "@ATTN@", name_of(t.attention));
  replace_all(s, "@DS@", deepspeed ? "\"ds_config.json\"" : "None");
  replace_all(s, "@QUANT@", quant);
  replace_all(s, "@FULL@", py_bool(in.peft.adapters.empty()));
  replace_all(s, "@LR@", fmt::format("{}", t.lr));
  replace_all(s, "@WD@", fmt::format("{}", t.weight_decay));
  replace_all(s, "@BETA1@", fmt::format("{}", t.adam_beta1));
  replace_all(s, "@BETA2@", fmt::format("{}", t.adam_beta2));
  replace_all(s, "@EPS@", fmt::format("{}", t.adam_eps));
  replace_all(s, "@CLIP@", fmt::format("{}", t.grad_clip));
  replace_all(s, "@MOMENTUM@", fmt::format("{}", planner::DsExtras{}.sgd_momentum));  // what ds_config.json writes
  replace_all(s, "@REENTRANT@", py_bool(t.checkpoint_reentrant));
  replace_all(s, "@FSDP_CKPT@", py_bool(planner::fsdp_checkpoints_layers(in.strategy, t)));
  replace_all(s, "@CE@", name_of(t.cross_entropy));
  replace_all(s, "@OPTIM@", name_of(t.optimizer));
  replace_all(s, "@SHARDS@", py_bool(planner::shards_params(in.strategy.stage)));
  // The id last (no field of ours is looked for inside it), as a Python string literal (a JSON
  // string is one), so a path with quotes or backslashes stays a string; the docstring takes it
  // without the quotes.
  const std::string literal = nlohmann::json(model_id).dump();
  replace_all(s, "@MODEL_ID@", literal);
  replace_all(s, "@MODEL_DOC@", literal.substr(1, literal.size() - 2));
  return s;
}

std::vector<std::string> emit_launch_files(const std::filesystem::path& dir, const planner::Candidate& row, const sim::Cluster& planned_on, std::int64_t eval_batch,
                       const std::string& model_arg, const std::string& tool) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw input_error(dir.string(), "", fmt::format("the folder cannot be made ({})", ec.message()));
  // A name taken by a folder would stop the writes half-way: refused before any file is written.
  constexpr std::array<std::string_view, 6> kNames = {"plan.json", "ds_config.json", "accelerate_config.yaml", "adapter_config.json", "train.py", "launch.sh"};
  for (std::string_view name : kNames)
    if (std::filesystem::is_directory(dir / name, ec))
      throw input_error((dir / name).string(), "", "is a folder, where a launch file goes (nothing was written)");
  planner::PlanInput in = row.input;
  in.training.eval_batch = eval_batch;  // a search plans without the evaluation peak
  const sim::Cluster cluster = planner::cluster_for_gpus(planned_on, in.strategy.ranks);
  const std::int32_t per_node = std::max(1, cluster.gpus_per_node);
  const std::int32_t machines = (in.strategy.ranks + per_node - 1) / per_node;
  const std::int32_t procs_per_machine = std::min(in.strategy.ranks, per_node);
  const bool deepspeed = planner::launches_with_deepspeed(in);
  const std::string model_id = model_id_for(model_arg);

  planner::PlanFile pf;
  pf.input = in;
  pf.model_source = planner::model_source_for(model_arg);
  pf.cluster = cluster;
  std::vector<std::pair<std::string_view, std::string>> texts;  // name, contents; written together at the end
  texts.emplace_back("plan.json", planner::plan_file_to_json(pf).dump(2) + "\n");
  if (deepspeed) {
    texts.emplace_back("ds_config.json", planner::write_ds_config(in.strategy, in.training).dump(2) + "\n");
    // accelerate's DeepSpeed launch config: the ds_config file carries every ZeRO setting.
    texts.emplace_back("accelerate_config.yaml",
                      fmt::format("# accelerate launch --config_file accelerate_config.yaml train.py (written by {})\n"
                                  "compute_environment: LOCAL_MACHINE\n"
                                  "distributed_type: DEEPSPEED\n"
                                  "deepspeed_config:\n"
                                  "  deepspeed_config_file: ds_config.json\n"
                                  "{}"
                                  "  zero3_init_flag: {}\n"
                                  "machine_rank: 0\n"
                                  "main_training_function: main\n"
                                  "num_machines: {}\n"
                                  "num_processes: {}\n"
                                  "rdzv_backend: static\n"
                                  "same_network: true\n"
                                  "use_cpu: false\n",
                                  tool,
                                  // Several machines: accelerate starts each one's processes itself
                                  // (its default, pdsh, would ssh from machine 0 through a hostfile).
                                  machines > 1 ? "  deepspeed_multinode_launcher: standard\n" : "",
                                  in.strategy.stage == planner::Stage::zero3 ? "true" : "false", machines, in.strategy.ranks));
  } else {
    texts.emplace_back("accelerate_config.yaml", planner::write_accelerate_config(in.strategy, in.training, machines));
  }
  if (!in.peft.adapters.empty() && in.peft.adapters[0].type == models::PeftType::lora) {
    // PEFT's save_pretrained writes inference_mode true (the adapter as saved for inference);
    // a config to train from says false, or get_peft_model would freeze the adapter.
    nlohmann::json a = models::lora_adapter_config(in.peft.adapters[0], model_id);
    a["inference_mode"] = false;
    texts.emplace_back("adapter_config.json", a.dump(2) + "\n");
  }
  texts.emplace_back("train.py", train_py(row, model_id, deepspeed));

  std::string sh = fmt::format(
      "#!/bin/sh\n"
      "# Launch lines for {family} on {gpus} GPU(s) ({machines} machine(s) x {ppm}), written by {tool}.\n"
      "# Run from this folder; pass the data to train.py (--data FILE or --dataset NAME). On several machines run the\n"
      "# same line on each with MACHINE_RANK=0..{last} and MAIN_ADDR set to machine 0's address.\n"
      "set -e\n"
      "cd \"$(dirname \"$0\")\"\n"
      "MACHINE_RANK=${{MACHINE_RANK:-0}}\n"
      "MAIN_ADDR=${{MAIN_ADDR:-127.0.0.1}}\n"
      "case \"${{1:-accelerate}}\" in\n"
      "  accelerate) [ $# -gt 0 ] && shift\n"
      "    exec accelerate launch --config_file accelerate_config.yaml --num_machines {machines} --num_processes {gpus} \\\n"
      "      --machine_rank \"$MACHINE_RANK\" --main_process_ip \"$MAIN_ADDR\" --main_process_port 29500 train.py \"$@\" ;;\n",
      fmt::arg("family", row.family), fmt::arg("gpus", in.strategy.ranks), fmt::arg("machines", machines), fmt::arg("ppm", procs_per_machine),
      fmt::arg("last", machines - 1), fmt::arg("tool", tool));
  // DeepSpeed's own launcher on one machine only: on several it reads the machines from a
  // hostfile and starts them over ssh (DeepSpeed's "Resource Configuration (multi-node)"), where
  // these lines run once per machine.
  const bool deepspeed_line = deepspeed && machines == 1;
  // torchrun starts train.py bare: right for DeepSpeed (train.py hands the Trainer ds_config.json)
  // and DDP, but FSDP's settings live in accelerate's YAML, so an FSDP row launches with accelerate.
  const bool torchrun_line = !planner::is_fsdp(in.strategy.stage);
  if (deepspeed_line)
    sh += fmt::format("  deepspeed) shift\n"
                      "    exec deepspeed --num_nodes {} --num_gpus {} --node_rank \"$MACHINE_RANK\" --master_addr \"$MAIN_ADDR\" --master_port 29500 \\\n"
                      "      train.py \"$@\" ;;\n",
                      machines, procs_per_machine);
  if (torchrun_line)
    sh += fmt::format("  torchrun) shift\n"
                      "    exec torchrun --nnodes {} --nproc_per_node {} --node_rank \"$MACHINE_RANK\" --master_addr \"$MAIN_ADDR\" --master_port 29500 \\\n"
                      "      train.py \"$@\" ;;\n",
                      machines, procs_per_machine);
  sh += fmt::format(
      "  twin) shift\n"
      "    # A scaled-down twin on this machine, run by peftplan's own executor: the same strategy family and offload, the\n"
      "    # same micro-batch, accumulation and checkpointing, a tiny Llama of {} ranks, on the CPU over MPI. It checks that\n"
      "    # the plan's memory walk and step program hold for this placement; it does not check the real model's size,\n"
      "    # GPU kernels, NCCL, bf16, or what transformers, PEFT, DeepSpeed and FSDP add outside the program{}.\n"
      "    exec {} \"$@\" ;;\n"
      "  *) echo \"usage: $0 [accelerate|{}{}twin] [train.py arguments]\" >&2; exit 2 ;;\n"
      "esac\n",
      std::min(in.strategy.ranks, 4), planner::is_fsdp(in.strategy.stage) ? " (an FSDP row runs as the ZeRO stage that shards the same states)" : "",
      twin_line(row), deepspeed_line ? "deepspeed|" : "", torchrun_line ? "torchrun|" : "");
  texts.emplace_back("launch.sh", std::move(sh));
  std::vector<FileToWrite> files;
  for (const auto& [name, text] : texts) files.push_back({"", dir / name, text});
  write_files_together(files);
  std::filesystem::permissions(dir / "launch.sh", std::filesystem::perms::owner_exec | std::filesystem::perms::group_exec | std::filesystem::perms::others_exec,
                               std::filesystem::perm_options::add, ec);
  std::vector<std::string> stale;
  for (std::string_view name : kNames)
    if (std::none_of(texts.begin(), texts.end(), [&](const auto& t) { return t.first == name; }) && std::filesystem::exists(dir / name, ec))
      stale.emplace_back(name);
  return stale;
}

std::string stale_launch_files_note(const std::filesystem::path& dir, const std::vector<std::string>& stale) {
  if (stale.empty()) return "";
  return fmt::format("note: {} still holds {} from an earlier plan, which this one does not use", dir.string(), fmt::join(stale, ", "));
}

}  // namespace peftplan::reports
