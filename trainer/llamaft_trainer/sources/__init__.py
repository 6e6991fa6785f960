"""Where a model's or dataset's files come from: the Hugging Face Hub client (hub) and the fetching
of Hub, fsspec and volume sources onto the node (downloads), for the model and the data wings."""
