"""The versioned wire contract between agent and collector: the .proto files and their generated Python code."""
