"""Transfer plane: the control protocol (versioned msgspec messages over TCP) and the data
paths (inline TCP stream, same-host shared memory, NIXL)."""
