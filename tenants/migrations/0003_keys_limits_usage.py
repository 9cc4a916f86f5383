import django.core.validators
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tenants', '0002_default_tenant'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='tenant',
            name='allowed_models',
            field=models.JSONField(blank=True, default=list, help_text='Served model names this tenant may use, e.g. ["llama-3-8b"]; empty: all.'),
        ),
        migrations.AddField(
            model_name='tenant',
            name='daily_token_budget',
            field=models.PositiveBigIntegerField(blank=True, help_text='Tokens per UTC day; empty: no limit.', null=True, validators=[django.core.validators.MinValueValidator(1)]),
        ),
        migrations.AddField(
            model_name='tenant',
            name='gpu_share',
            field=models.PositiveSmallIntegerField(default=0, help_text="Percent of the GPU's tokens guaranteed while the tenant has work waiting; 0: no guarantee (weighted as 1%). Active tenants' shares add up to at most 100.", validators=[django.core.validators.MaxValueValidator(100)]),
        ),
        migrations.AddField(
            model_name='tenant',
            name='max_concurrent_requests',
            field=models.PositiveIntegerField(blank=True, help_text='Requests in flight at once; empty: no limit.', null=True, validators=[django.core.validators.MinValueValidator(1)]),
        ),
        migrations.AddField(
            model_name='tenant',
            name='members',
            field=models.ManyToManyField(blank=True, help_text="Users who may see this tenant's pages (keys and usage).", related_name='tenants', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddField(
            model_name='tenant',
            name='priority',
            field=models.SmallIntegerField(default=0, help_text='Lower goes first between tenants that are equally far below their shares.'),
        ),
        migrations.AddField(
            model_name='tenant',
            name='requests_per_minute',
            field=models.PositiveIntegerField(blank=True, help_text='Empty: no limit.', null=True, validators=[django.core.validators.MinValueValidator(1)]),
        ),
        migrations.AddField(
            model_name='tenant',
            name='tokens_per_minute',
            field=models.PositiveIntegerField(blank=True, help_text='Prompt + completion tokens; empty: no limit.', null=True, validators=[django.core.validators.MinValueValidator(1)]),
        ),
        migrations.AlterField(
            model_name='tenant',
            name='active',
            field=models.BooleanField(default=True, help_text='Inactive tenants are refused (403).'),
        ),
        migrations.AlterField(
            model_name='tenant',
            name='slug',
            field=models.SlugField(help_text='What clients send in X-Tenant-ID.', max_length=64, unique=True),
        ),
        migrations.CreateModel(
            name='ApiKey',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(blank=True, help_text='What the key is for.', max_length=100)),
                ('prefix', models.CharField(editable=False, help_text='The first characters of the key, to recognise it.', max_length=12)),
                ('key_hash', models.CharField(editable=False, max_length=64, unique=True)),
                ('created', models.DateTimeField(auto_now_add=True)),
                ('expires_at', models.DateTimeField(blank=True, help_text='Empty: never expires.', null=True)),
                ('revoked_at', models.DateTimeField(blank=True, editable=False, null=True)),
                ('last_used_at', models.DateTimeField(blank=True, editable=False, null=True)),
                ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='api_keys', to='tenants.tenant')),
            ],
            options={
                'verbose_name': 'API key',
                'ordering': ['tenant', '-created'],
            },
        ),
        migrations.CreateModel(
            name='Usage',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('model', models.CharField(blank=True, help_text='Served model name; empty when not known.', max_length=200)),
                ('hour', models.DateTimeField(help_text='Start of the UTC hour.')),
                ('requests', models.PositiveBigIntegerField(default=0)),
                ('prompt_tokens', models.PositiveBigIntegerField(default=0)),
                ('completion_tokens', models.PositiveBigIntegerField(default=0)),
                ('errors_invalid_request', models.PositiveBigIntegerField(default=0, help_text='400, 403, 404.')),
                ('errors_rate_limited', models.PositiveBigIntegerField(default=0, help_text='429.')),
                ('errors_unavailable', models.PositiveBigIntegerField(default=0, help_text='503: no worker, worker lost.')),
                ('errors_aborted', models.PositiveBigIntegerField(default=0, help_text='The client left before the end.')),
                ('errors_internal', models.PositiveBigIntegerField(default=0, help_text='500.')),
                ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='usage', to='tenants.tenant')),
            ],
            options={
                'verbose_name_plural': 'usage',
                'ordering': ['-hour', 'tenant', 'model'],
                'constraints': [models.UniqueConstraint(fields=('tenant', 'model', 'hour'), name='usage_tenant_model_hour')],
            },
        ),
    ]
