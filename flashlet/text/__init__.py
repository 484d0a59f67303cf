"""Text in and out: tokenizing, detokenizing, structured output."""
