"""Heron in other frameworks, one module each, installed with an extra of heron-sdk:
``heron_sdk.integrations.langchain`` (``heron-sdk[langchain]``),
``heron_sdk.integrations.llama_index`` (``heron-sdk[llamaindex]``) and
``heron_sdk.integrations.haystack`` (``heron-sdk[haystack]``). Importing this package
imports no framework (docs/frameworks.md)."""
