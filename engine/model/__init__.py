"""The model of a run: loading the tokenizer and weights from a folder (loading) and the fine-tuning method objects chosen once at assembly (methods)."""
