"""Evaluation: SQuAD metrics and runs, abstention, the needle test and the benchmarks."""
