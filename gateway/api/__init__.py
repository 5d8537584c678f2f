"""HTTP routers only: parse, validate, call a service object, shape the response."""
