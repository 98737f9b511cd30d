"""gRPC server that receives agent streams, writes them to ClickHouse/chDB in batches, runs the online diagnosis and answers read-only queries."""
