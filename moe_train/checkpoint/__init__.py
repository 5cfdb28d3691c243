"""DCP checkpoints (save, load, resume) and Hugging Face import/export."""
