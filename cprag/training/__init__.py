"""CPLM training: examples, activation caches, batches, the loop and the recipe."""
