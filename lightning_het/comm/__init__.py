"""The gradient communication algorithms (``comm=``): docs/communication.md."""
