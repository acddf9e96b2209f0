"""Developer and operator commands behind the specstream CLI: file tools and build checks."""
