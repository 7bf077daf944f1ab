"""Workloads: the requests a simulation serves -- arrivals, lengths, traces, tenants' rate limits and SLOs."""
