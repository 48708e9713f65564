"""The configuration, in four modules that import one another in this order only (no cycle):
`schema` (the dataclasses), `derived` (quantities computed from them), `validate` (the checks that
refuse a config before any work starts) and `hydra` (registration, conversion of a composed node
into a validated `Config`, the error text for what OmegaConf refuses). Nothing here imports torch;
Hydra and OmegaConf are imported only inside the functions of `hydra` that need them."""
