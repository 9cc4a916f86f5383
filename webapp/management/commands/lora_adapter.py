"""``manage.py lora_adapter add NAME PATH --base-model MODEL [--tenant SLUG]``, ``lora_adapter remove NAME``,
``lora_adapter list``: register LoRA adapters as the admin does (docs/lora_serving.md).

``add`` checks the folder and its config and that no served model or start-up adapter has the name, then, when
a worker of the base model is ready, has it load the adapter (rank, files, shapes) and registers it only if that
worker accepted it. With ``REDIS_URL`` the
deployment's, every worker of the base model loads it within a heartbeat.
"""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from redis.exceptions import RedisError

from tenants.models import Tenant
from webapp.catalog.lora import registration_problem
from webapp.catalog.models import LoRAAdapter


class Command(BaseCommand):
    help = "Add, remove or list the LoRA adapters served as models (public, or owned by a tenant)."

    def add_arguments(self, parser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="Register an adapter.")
        add.add_argument("name", help="The name clients send as 'model'.")
        add.add_argument("path", help="The PEFT adapter's folder, as the workers see it.")
        add.add_argument("--base-model", required=True, help="The served model it runs on.")
        add.add_argument("--tenant", help="The owning tenant's slug (only its keys may use it); default: public.")
        remove = sub.add_parser("remove", help="Unregister an adapter (every worker unloads it).")
        remove.add_argument("name")
        sub.add_parser("list", help="List the registered adapters.")

    def handle(self, *args, **options) -> None:
        if options["action"] == "list":
            for a in LoRAAdapter.objects.select_related("tenant"):
                self.stdout.write(f"{a.name}\t{a.base_model}\t{a.tenant.slug if a.tenant else '(public)'}\t{a.path}")
        elif options["action"] == "remove":
            if not LoRAAdapter.objects.filter(name=options["name"]).delete()[0]:
                raise CommandError(f"No LoRA adapter '{options['name']}'.")
            self.stderr.write(f"LoRA adapter '{options['name']}' removed.")
        else:
            self._add(options)

    def _add(self, options: dict) -> None:
        tenant = None
        if options["tenant"]:
            tenant = Tenant.objects.filter(slug=options["tenant"]).first()
            if tenant is None:
                raise CommandError(f"No tenant '{options['tenant']}'.")
        adapter = LoRAAdapter(name=options["name"], base_model=options["base_model"], path=options["path"].strip(),
                              tenant=tenant)
        try:
            adapter.full_clean()
        except ValidationError as error:
            problems = "; ".join(f"{field}: {' '.join(messages)}" for field, messages in error.message_dict.items())
            raise CommandError(f"Cannot add LoRA adapter '{adapter.name}': {problems}") from None
        try:
            problem, checked = registration_problem(adapter.name, adapter.base_model, adapter.path)
        except RedisError as error:
            problem, checked = None, True
            self.stderr.write(f"Warning: Redis is unreachable ({error}); served names are not checked, and the "
                              "workers check the adapter when they load it.")
        if problem is not None:
            raise CommandError(f"Cannot add LoRA adapter '{adapter.name}': {problem[1]}")
        if not checked:
            self.stderr.write(f"No worker of '{adapter.base_model}' is ready: the rank and the shapes are checked "
                              "when one loads it.")
        adapter.save()
        owner = f"tenant '{tenant.slug}'" if tenant else "public"
        self.stderr.write(f"LoRA adapter '{adapter.name}' on '{adapter.base_model}' added ({owner}).")
