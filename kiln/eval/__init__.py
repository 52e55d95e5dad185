"""Accuracy evaluation (``kiln eval``): summarization ROUGE, perplexity, parity with Hugging Face."""
