"""Admin: the served-model catalog, the LoRA adapters, and the workers with their load / unload / reload actions.

The actions only queue a command for each chosen worker (:mod:`webapp.serving.commands`)
and return; the worker loads in its own process, and the workers' page shows its state
(``loading``, then ``ready``, or ``failed`` with the error) from its next heartbeats.
"""
from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ActionForm
from redis.exceptions import RedisError

from webapp.serving.commands import LOAD, RELOAD, UNLOAD, ModelCommand

from .lora import registration_problem
from .models import LoRAAdapter, ServedModel, Worker
from .workers import command_workers, sync_workers


def _sync(request) -> None:
    try:
        sync_workers()
    except RedisError as error:
        messages.error(request, f"Redis cannot be read, so workers are shown as last seen: {error}")


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin):
    list_display = ("name", "source", "dtype", "quantization", "max_model_len", "gpu_memory_utilization",
                    "max_num_seqs", "tensor_parallel_size", "enabled", "ready_workers")
    list_filter = ("enabled", "dtype")
    search_fields = ("name", "source")
    fields = ("name", "source", "dtype", "quantization", "max_model_len", "gpu_memory_utilization",
              "max_num_seqs", "tensor_parallel_size", "enabled")

    def changelist_view(self, request, extra_context=None):
        _sync(request)
        return super().changelist_view(request, extra_context)

    @admin.display(description="ready on")
    def ready_workers(self, obj: ServedModel) -> str:
        return ", ".join(Worker.objects.filter(model=obj.name, state=Worker.READY)
                         .values_list("worker_id", flat=True)) or "-"


class LoRAAdapterForm(forms.ModelForm):
    """Checks, beyond the fields: that no served model or start-up adapter has the name, and that a ready worker
    of the base model loads the adapter (rank, files, shapes), as ``manage.py lora_adapter add`` does."""

    class Meta:
        model = LoRAAdapter
        fields = ("name", "base_model", "path", "tenant")

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        try:
            problem, _ = registration_problem(data["name"], data["base_model"], data["path"].strip())
        except RedisError:
            problem = None  # Redis down: the workers check the adapter when they load it
        if problem is not None:
            self.add_error(*problem)
        return data


@admin.register(LoRAAdapter)
class LoRAAdapterAdmin(admin.ModelAdmin):
    """Adapters registered at run time: saved ones reach every worker of their base model within a heartbeat,
    deleted ones are unloaded there. The form checks the folder, its config and the name; a ready worker of
    the base model loads the adapter before it is saved (without one, the workers check it when they load it:
    a refused one is logged there, and its requests get the reason)."""

    form = LoRAAdapterForm

    list_display = ("name", "base_model", "tenant", "path", "created")
    list_filter = ("base_model", "tenant")
    search_fields = ("name", "base_model", "path")
    fields = ("name", "base_model", "path", "tenant")


class WorkerActionForm(ActionForm):
    served_model = forms.ModelChoiceField(queryset=ServedModel.objects.filter(enabled=True), required=False,
                                          label="Model", empty_label="(model to load)")


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    """Workers as their heartbeats describe them; actions send model commands to them."""

    list_display = ("worker_id", "host", "device", "memory", "model", "state", "error", "last_heartbeat")
    list_filter = ("state", "model")
    readonly_fields = ("worker_id", "host", "pid", "device", "memory_used_bytes", "memory_total_bytes", "model",
                       "state", "error", "last_heartbeat")
    action_form = WorkerActionForm
    actions = ["load_model", "unload_model", "reload_model"]

    def has_add_permission(self, request) -> bool:  # workers register themselves by their heartbeats
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:  # a stopped worker's row goes by itself
        return False

    def has_manage_permission(self, request) -> bool:
        """Who may run the model actions: users with the change permission on workers."""
        return request.user.has_perm("catalog.change_worker")

    def changelist_view(self, request, extra_context=None):
        _sync(request)
        return super().changelist_view(request, extra_context)

    @admin.display(description="memory")
    def memory(self, obj: Worker) -> str:
        if obj.memory_total_bytes is None:
            return "-"
        return f"{(obj.memory_used_bytes or 0) / 2**30:.1f} / {obj.memory_total_bytes / 2**30:.1f} GiB"

    def _live(self, request, queryset) -> list[Worker]:
        live = [w for w in queryset if w.state != Worker.OFFLINE]
        if len(live) < len(queryset):
            messages.warning(request, "Offline workers were skipped.")
        return live

    @admin.action(description="Load the chosen model on the selected workers (replacing theirs)",
                  permissions=["manage"])
    def load_model(self, request, queryset) -> None:
        served = request.POST.get("served_model")
        model = ServedModel.objects.filter(pk=served).first() if served and served.isdigit() else None
        if model is None:
            messages.error(request, "Choose the model to load in the 'Model' field next to the action.")
            return
        if not model.enabled:
            messages.error(request, f"The model '{model.name}' is disabled; enable it first.")
            return
        sent = command_workers(self._live(request, queryset), ModelCommand(LOAD, model.spec()))
        messages.info(request, f"Loading '{model.name}' on {sent} worker(s); their state shows the progress.")

    @admin.action(description="Unload the model of the selected workers", permissions=["manage"])
    def unload_model(self, request, queryset) -> None:
        sent = command_workers(self._live(request, queryset), ModelCommand(UNLOAD))
        messages.info(request, f"Unloading on {sent} worker(s); their running requests end with an error.")

    @admin.action(description="Reload the model of the selected workers (with its current settings)",
                  permissions=["manage"])
    def reload_model(self, request, queryset) -> None:
        sent = 0
        for worker in self._live(request, queryset):
            if not worker.model:
                messages.warning(request, f"Worker {worker.worker_id} has no model to reload.")
                continue
            model = ServedModel.objects.filter(name=worker.model).first()
            sent += command_workers([worker], ModelCommand(RELOAD, model.spec() if model else None))
        messages.info(request, f"Reloading on {sent} worker(s).")
