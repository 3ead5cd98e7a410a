"""rollout-hpc export-model RUN_DIR --out DIR: the trained policy as a Hugging Face model directory."""

from __future__ import annotations

import argparse
import json

from rollout_hpc.commands import err, out


def cmd_export_model(args: argparse.Namespace) -> int:
    from rollout_hpc.models.export import export_model  # in here: torch and transformers; the CLI must start fast

    result = export_model(
        args.run_dir,
        args.out,
        step=args.step,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        force=args.force,
        progress=not args.quiet and not args.json,
        warn=lambda line: err.print(f"rollout-hpc: {line}", markup=False, highlight=False),
        adapter_only=args.adapter_only,
    )
    if args.json:
        print(json.dumps({k: v for k, v in result.info.items() if k != "config"} | {"out": str(result.out)}, indent=2))
        return 0
    mb = result.total_bytes / 1e6
    out.print(
        f"exported step {result.step} (policy version {result.policy_version}) of {result.info['run_dir']}",
        markup=False,
        highlight=False,
    )
    out.print(f"  to              {result.out}", markup=False, highlight=False)
    out.print(
        f"  weights         {result.n_tensors} tensors, {mb:.1f} MB {result.dtype}, "
        f"{sum(f.endswith('.safetensors') for f in result.files)} safetensors file(s)",
        markup=False,
    )
    out.print(f"  from            {result.checkpoint} ({result.info['weights_from']})", markup=False, highlight=False)
    out.print(
        f"  weights sha256  {result.info['weights_sha256']} (the checkpoint's, as `rollout-hpc ckpt` shows)",
        markup=False,
    )
    load = (
        f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), {str(result.out)!r})"
        if args.adapter_only
        else f"AutoModelForCausalLM.from_pretrained({str(result.out)!r}), AutoTokenizer.from_pretrained({str(result.out)!r})"
    )
    out.print(f"  load it with    {load}", markup=False, highlight=False)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export-model",
        help="write a run's trained policy as a Hugging Face model directory (safetensors + tokenizer)",
        description="Writes config.json, generation_config.json, the weights as safetensors (sharded above "
        "--max-shard-size, with model.safetensors.index.json), the tokenizer files and rollout_hpc_export.json (run, "
        "step, policy version, config digest, SHA-256s) from the newest checkpoint of RUN_DIR that verifies (a damaged "
        "newer one is named and skipped) or from --step N. Reads torch and DeepSpeed ZeRO checkpoints (every shard "
        "merged) and Megatron's. The directory loads with transformers' AutoModelForCausalLM / AutoTokenizer without "
        "rollout-hpc (the layout vLLM reads too).",
        epilog="examples:\n  rollout-hpc export-model runs/quickstart --out models/quickstart\n"
        "  rollout-hpc export-model runs/gsm8k --out /models/gsm8k-step200 --step 200 --dtype bfloat16\n"
        "  python -c \"import transformers as t; t.AutoModelForCausalLM.from_pretrained('models/quickstart')\"",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory made by `rollout-hpc submit`")
    p.add_argument(
        "--out", required=True, metavar="DIR", help="the model directory to write (must not exist or be empty)"
    )
    p.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help="export the checkpoint of step N (default: the newest valid one)",
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="dtype of the written weights (default: the run's model.dtype)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest safetensors file before the weights are split (default 5GB; 500MB, 2GiB, ...)",
    )
    lora = p.add_mutually_exclusive_group()
    lora.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run (model.lora): merge the adapters into the base model and write a full model (the default)",
    )
    lora.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run: write only the adapters in the PEFT layout (adapter_config.json, adapter_model.safetensors) "
        "for peft.PeftModel.from_pretrained(base, DIR)",
    )
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the export record (rollout_hpc_export.json) as JSON")
    p.set_defaults(func=cmd_export_model)
