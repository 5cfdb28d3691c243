"""Built-in recipes, resolvable by name (moe-train recipes list)."""
