"""The environment a job runs in: network interface, variables that exist, the timeout
hierarchy, versions, and ``init_process_group`` with timeouts that nest."""
