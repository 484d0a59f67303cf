"""KV memory: the paged pool and the radix prefix cache."""
