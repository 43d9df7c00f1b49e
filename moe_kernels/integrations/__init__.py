"""Integrations with other libraries' model code. Each submodule imports its library when it is
imported itself; `import moe_kernels` imports none of them."""
