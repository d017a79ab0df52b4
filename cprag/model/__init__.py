"""The Copy-Paste LM: its math (config, mixture, CP head, CPLM), its backbone, weights and runtime."""
