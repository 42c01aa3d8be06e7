"""Built-in parsim cluster descriptions (one YAML file per cluster); a package so installed copies find them."""
