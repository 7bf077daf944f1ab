"""The simulators: the JAX engine, its plain-Python reference, queue orders, prefix caching and their outcome."""
