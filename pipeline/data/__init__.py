"""Data: sources (Hub or local mirror), normalising, the sampling plan and schemas the data stages use."""
