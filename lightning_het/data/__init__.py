"""The data path: samplers that split global batches by share, DataLoader rebuilding, the data-module base."""
