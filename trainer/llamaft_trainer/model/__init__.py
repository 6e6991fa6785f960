"""The model: tokenizer, config and a meta-device model with its adapters (model), its weights
streamed in tensor by tensor (loading), attention over packed CPU rows (attention)."""
