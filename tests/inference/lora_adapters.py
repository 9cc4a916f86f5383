"""PEFT LoRA adapters made for the tests, with random non-zero ``lora_B`` (PEFT starts it at zero, which
would leave the model unchanged), and transformers + peft as the reference."""
from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(model, folder: Path, r: int, alpha: float, targets: list[str], seed: int,
                      use_rslora: bool = False, b_std: float = 0.02):
    """Wrap ``model`` (a transformers causal LM, modified in place) in a PEFT LoRA adapter, randomize its
    weights from ``seed``, save it to ``folder`` and return the ``PeftModel`` (``.unload()`` gives the base back)."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                        use_rslora=use_rslora, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)
            elif "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
    peft_model.save_pretrained(folder)
    return peft_model.eval()


def two_adapters_with_reference(model, folder: Path, prompts: list[list[int]], num_tokens: int, b_std: float = 0.02):
    """Adapters ``a`` (rank 8, every projection) and ``b`` (rank 16, rsLoRA, five projections) of ``model``
    written to ``folder``, and transformers + peft's greedy tokens of ``prompts`` under the base model, ``a`` and
    ``b``. Returns ``(reference {None | "a" | "b": [tokens per prompt]}, {name: LoRARequest | None})``."""
    from inference import LoRARequest

    from .conftest import hf_greedy
    reference = {None: [hf_greedy(model, p, num_tokens) for p in prompts]}
    specs = {"a": dict(r=8, alpha=16, targets=ALL_TARGETS, seed=1, b_std=b_std),
             "b": dict(r=16, alpha=8, targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], seed=2,
                       use_rslora=True, b_std=b_std)}
    for name, spec in specs.items():
        peft_model = make_peft_adapter(model, folder / name, **spec)
        reference[name] = [hf_greedy(peft_model, p, num_tokens) for p in prompts]
        model = peft_model.unload()
    assert reference["a"] != reference[None] and reference["b"] != reference[None] != reference["a"]
    requests = {None: None, "a": LoRARequest("a", 1, str(folder / "a")), "b": LoRARequest("b", 2, str(folder / "b"))}
    return reference, requests
