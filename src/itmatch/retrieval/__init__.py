"""Retrieval: a global first stage (FAISS) and exact re-ranking of its top K with a model's pair head."""
