"""What every part of rankscope may import, and that imports no part: the incident and finding
types and their SQL, the diagnosis settings, the fault grammar, the agent's environment, and
process and command-line helpers. Standard library only (and the wire contract)."""
