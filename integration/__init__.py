"""Integration tooling around vLLM: the P/D proxy (`proxy`), the pool launcher (`launcher`) and
example `--kv-transfer-config` files (`configs/`)."""
