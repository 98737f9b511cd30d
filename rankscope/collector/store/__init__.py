"""Storage: the schema as data, the DDL generated from it, and the chDB and ClickHouse-server backends."""
