"""Judging a repacked model in llama.cpp: ``check-dropin``'s four gates and the judge's logits
and routing comparison, each run in its own worker."""
