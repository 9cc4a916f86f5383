"""Scheduling: the scheduler, its policies, multi-step decode windows, tenant fair share and
parallel samples (plain logic on requests and block ids, no I/O, no tensors)."""
