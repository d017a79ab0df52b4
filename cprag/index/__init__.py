"""The index: corpus -> passages -> CP keys in LanceDB + FAISS, and reading it back."""
