"""Engine core: scheduler, output processing and the step loop (plain logic, no I/O)."""
