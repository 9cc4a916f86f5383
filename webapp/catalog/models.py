"""The admin's view of serving: models that can be served, their LoRA adapters, and the live workers.

``ServedModel`` is the operator's catalog (the engine settings of each model). ``LoRAAdapter`` is an
adapter registered at run time, served as a model of its own on its base model's workers
(:mod:`.lora`). ``Worker``
mirrors the workers' Redis heartbeats (:mod:`webapp.serving.worker_registry`) so that the admin can
list them and run actions on them; Redis stays the source of truth (workers on any machine
write it, none writes this database), and the rows are refreshed from it whenever the
admin lists workers (:func:`webapp.catalog.workers.sync_workers`).
"""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from inference.engine.arg_utils import EngineArgs
from inference.errors import TesseraError
from inference.quantization.config import QUANTIZATION_METHODS
from webapp.serving.lora_registry import AdapterEntry
from webapp.serving.model_spec import ModelSpec

from .sources import validate_adapter_path, validate_source

DTYPES = [("auto", "auto (float32 on CPU, the checkpoint's on GPU)"), ("float32", "float32"),
          ("bfloat16", "bfloat16"), ("float16", "float16")]
CHECKED_FIELDS = ("dtype", "quantization", "max_model_len", "tensor_parallel_size")  # errors shown on the field
NAME_MAX_LENGTH = 200  # characters of a served model's or an adapter's name
NAME_RULE = RegexValidator(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*\Z",  # \Z: no trailing newline, unlike $
                           "Use letters, digits and . _ : / - (starting with a letter or digit).")


class ServedModel(models.Model):
    """A model the admin can load on a worker; clients call it by ``name``.

    ``enabled`` off: the model cannot be loaded (a loaded one keeps serving until unloaded).
    """

    name = models.CharField(max_length=NAME_MAX_LENGTH, unique=True, validators=[NAME_RULE],
                            help_text="The name clients send as \"model\" (vLLM's --served-model-name).")
    source = models.CharField(max_length=1000, validators=[validate_source],
                              help_text="The packaged model's name (smollm2-135m-instruct), a Hugging Face model "
                                        "directory, or a .gguf file, as the workers see it.")
    dtype = models.CharField(max_length=16, choices=DTYPES, default="auto")
    quantization = models.CharField(max_length=32, blank=True, default="",
                                    help_text="Weight quantization method; empty: none.")
    max_model_len = models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(16)],
                                                help_text="Context length in tokens (prompt + output); "
                                                          "empty: the model's.")
    gpu_memory_utilization = models.FloatField(default=0.9, validators=[MinValueValidator(0.01),
                                                                        MaxValueValidator(1.0)],
                                               help_text="Fraction of GPU memory for the engine, 0.01 to 1.")
    max_num_seqs = models.PositiveIntegerField(default=256, validators=[MinValueValidator(1),
                                                                        MaxValueValidator(65536)],
                                               help_text="Requests in one engine step.")
    tensor_parallel_size = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1),
                                                                                   MaxValueValidator(64)],
                                                            help_text="GPUs per engine.")
    enabled = models.BooleanField(default=True, help_text="Off: the model cannot be loaded.")
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "served model"

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """Refuse what no worker could load, on the field at fault: a quantization method the engine does not
        know, and what the model's config rules out (``EngineArgs.check_model``: ``max_model_len`` beyond the
        model's, a quantization the checkpoint does not have, a ``tensor_parallel_size`` that does not split
        its heads, an unsupported architecture). What depends on a worker's device (the number of GPUs, FP8
        support) is checked when a worker loads it."""
        super().clean()
        if self.quantization and self.quantization not in QUANTIZATION_METHODS:
            raise ValidationError({"quantization": f"Unknown method {self.quantization!r}: use one of "
                                                   f"{', '.join(QUANTIZATION_METHODS)}, or leave it empty."})
        try:
            validate_source(self.source)
        except ValidationError:
            return  # the field's own error is shown
        try:
            self.spec().engine_args(EngineArgs(model=self.source.strip())).check_model()
        except TesseraError as error:
            field = getattr(error, "param", None)
            raise ValidationError({field if field in CHECKED_FIELDS else "source": str(error)}) from None

    def spec(self) -> ModelSpec:
        """What a worker needs to load this model."""
        return ModelSpec(name=self.name, source=self.source.strip(), dtype=self.dtype,
                         quantization=self.quantization or None, max_model_len=self.max_model_len,
                         gpu_memory_utilization=self.gpu_memory_utilization, max_num_seqs=self.max_num_seqs,
                         tensor_parallel_size=self.tensor_parallel_size)


class LoRAAdapter(models.Model):
    """A LoRA adapter registered at run time; clients call it by ``name``, as a model.

    Owned by ``tenant``: only that tenant's requests may use it (to every other tenant it does not exist);
    without a tenant it is public, open to every tenant allowed its base model.
    """

    name = models.CharField(max_length=NAME_MAX_LENGTH, unique=True, validators=[NAME_RULE],
                            help_text="The name clients send as \"model\" (vLLM's lora_name); unique in the "
                                      "deployment.")
    base_model = models.CharField(max_length=NAME_MAX_LENGTH, validators=[NAME_RULE],
                                  help_text="The served model it runs on (the name its workers serve).")
    path = models.CharField(max_length=1000, validators=[validate_adapter_path],
                            help_text="The PEFT adapter's folder (adapter_config.json and "
                                      "adapter_model.safetensors), as the workers see it.")
    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE,
                               related_name="lora_adapters",
                               help_text="The tenant that owns it (only its keys may use it); empty: public.")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "LoRA adapter"

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """Refuse a name a served model already has, its own base model's included (the form shows it on the
        field): checked here, without Redis, so that no adapter takes a model's name while Redis is down."""
        super().clean()
        if self.name and (self.name == self.base_model or ServedModel.objects.filter(name=self.name).exists()):
            raise ValidationError({"name": f"'{self.name}' is a served model's name; an adapter needs a name of "
                                           "its own."})

    def entry(self) -> AdapterEntry:
        """The adapter as the workers' registry in Redis holds it."""
        return AdapterEntry(self.name, self.base_model, self.path.strip(), self.tenant.slug if self.tenant else None)


class Worker(models.Model):
    """A worker process as its last heartbeat described it (refreshed from Redis)."""

    IDLE, LOADING, READY, UNLOADING, FAILED, OFFLINE = "idle", "loading", "ready", "unloading", "failed", "offline"
    STATES = [(s, s) for s in (IDLE, LOADING, READY, UNLOADING, FAILED, OFFLINE)]

    worker_id = models.CharField(max_length=200, primary_key=True)
    host = models.CharField(max_length=255, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    device = models.CharField(max_length=255, blank=True)
    memory_used_bytes = models.BigIntegerField(null=True, blank=True)
    memory_total_bytes = models.BigIntegerField(null=True, blank=True)
    model = models.CharField(max_length=200, blank=True, help_text="The served model's name; empty: none.")
    state = models.CharField(max_length=16, choices=STATES, default=IDLE)
    error = models.TextField(blank=True, help_text="Why the last load failed.")
    last_heartbeat = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["host", "worker_id"]

    def __str__(self) -> str:
        return self.worker_id
