"""A real Hugging Face Hub API server on loopback (olah, offline, serving local git repositories) for
the tests that read models and datasets by Hub id through huggingface_hub, transformers and datasets."""
