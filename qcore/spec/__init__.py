"""What a scheme's bytes and numbers mean: value and scale traits, schemes, layout, payload, arithmetic."""
