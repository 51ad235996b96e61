"""What the tests share: servers, clients, stand-ins, models made on the spot."""
