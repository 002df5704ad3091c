"""Request handlers, one module per API family; routes.py maps paths to them."""
