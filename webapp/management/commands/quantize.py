"""``manage.py quantize --model SRC --output-dir DST --quantization awq|gptq``: write a 4-bit checkpoint
that Tessera and transformers load (a thin wrapper over ``inference.quantization.quantize``)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from django.core.management.base import BaseCommand, CommandError

from inference.errors import TesseraError
from inference.quantization.quantize import CalibrationConfig, quantize_model
from webapp.cli import DEFAULT_MODEL


class Command(BaseCommand):
    help = "Quantize a model with AWQ or GPTQ (4-bit) on the shipped calibration text and write the checkpoint."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--model", default=DEFAULT_MODEL,
                            help=f"Source: the packaged '{DEFAULT_MODEL}' (default), a Hugging Face directory "
                                 "or a .gguf file.")
        parser.add_argument("--output-dir", required=True, help="Directory to write the checkpoint to.")
        parser.add_argument("--quantization", "-q", required=True, choices=["awq", "gptq"])
        parser.add_argument("--group-size", type=int, default=None,
                            help="Input channels per scale: a multiple of 16 dividing the layers' input features, or -1 "
                                 "(per channel); default: the largest of 128/64/32 dividing them.")
        order = parser.add_mutually_exclusive_group()
        order.add_argument("--static-groups", dest="act_order", action="store_const", const="static",
                           help="GPTQ act-order with each group's scale fixed before the columns are visited: "
                                "groups stay consecutive input rows (GPTQ's default here; see docs/quantization.md).")
        order.add_argument("--desc-act", dest="act_order", action="store_const", const="full",
                           help="GPTQ act-order with groups formed in the visiting order (g_idx scatters them).")
        order.add_argument("--no-desc-act", dest="act_order", action="store_const", const="none",
                           help="GPTQ without act-order.")
        parser.add_argument("--num-samples", type=int, default=16, help="Calibration sequences (default: 16).")
        parser.add_argument("--seq-len", type=int, default=256, help="Tokens per calibration sequence (default: 256).")
        parser.add_argument("--device", default="cpu", help="Where the float model runs (cpu, cuda; default: cpu).")

    def handle(self, *args, **options) -> None:
        logging.getLogger("inference").setLevel(logging.INFO)
        if options["num_samples"] < 1 or options["seq_len"] < 2:
            raise CommandError("--num-samples must be at least 1 and --seq-len at least 2.")
        try:
            device = torch.device(options["device"])
        except RuntimeError as exc:
            raise CommandError(f"--device {options['device']!r} is not a device name (cpu, cuda, cuda:N).") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise CommandError(f"--device {options['device']}: this machine has no CUDA GPU; use --device cpu.")
        if options["act_order"] and options["quantization"] != "gptq":
            raise CommandError("--static-groups, --desc-act and --no-desc-act apply to GPTQ only (--quantization gptq).")
        act_order = options["act_order"] or ("static" if options["quantization"] == "gptq" else "none")
        if not options["output_dir"].strip():
            raise CommandError("--output-dir is empty; name a new directory.")
        output = Path(options["output_dir"])
        if output.exists() and (not output.is_dir() or any(output.iterdir())):
            raise CommandError(f"--output-dir {output} exists and is not an empty directory; choose a new one.")
        _check_creatable(output)
        created = not output.exists()
        try:  # before the calibration (minutes): a folder that cannot be made fails now
            output.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CommandError(f"--output-dir {output} cannot be created: {exc.strerror}.") from exc
        try:
            out = quantize_model(options["model"], options["output_dir"], options["quantization"],
                                 group_size=options["group_size"], desc_act=act_order != "none",
                                 static_groups=act_order == "static",
                                 calibration=CalibrationConfig(options["num_samples"], options["seq_len"]),
                                 device=options["device"])
        except BaseException as exc:  # nothing written: the folder made above goes too
            if created and output.is_dir() and not any(output.iterdir()):
                output.rmdir()
            if isinstance(exc, TesseraError):
                raise CommandError(str(exc)) from exc
            raise
        self.stdout.write(f"Wrote {options['quantization'].upper()} checkpoint to {out}")


def _check_creatable(output: Path) -> None:
    """Refuse, before the calibration (minutes), an output directory that could not be created:
    its nearest existing ancestor is no directory, or not writable."""
    parent = output.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise CommandError(f"--output-dir {output} cannot be created: {parent} is not a writable directory.")
