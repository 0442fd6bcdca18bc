"""The quantization schemes a store can hold, by name: what `--quant` offers. Their byte layouts
are mira.store.layout's; the names live apart so that naming them needs no torch."""

SCHEMES = ("int8-shared", "int8-row", "int4", "none")
