"""Evaluation of a trained model (`llmtrain eval`, and eval.tasks during training): held-out
perplexity and bits per byte, multiple-choice accuracy, and the lm-evaluation-harness."""
