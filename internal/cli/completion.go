package cli

import (
	"fmt"

	"github.com/spf13/cobra"
)

// bashShim defines, where the bash-completion package is not loaded, the
// two of its functions that cobra's bash script calls: without them every
// TAB printed "_get_comp_words_by_ref: command not found". These minimal
// ones complete commands, flags, names and files; a flag's value after
// '=' completes best with the package installed.
const bashShim = `# gpushm: without the bash-completion package, minimal versions of the two
# of its functions this script calls.
if ! declare -F _get_comp_words_by_ref >/dev/null 2>&1; then
_get_comp_words_by_ref() {
    while [[ $# -gt 0 && $1 == -* ]]; do
        [[ $1 == -n ]] && shift
        shift
    done
    local __gpushm_v
    for __gpushm_v in "$@"; do
        case $__gpushm_v in
        cur) cur=${COMP_WORDS[COMP_CWORD]} ;;
        prev) prev=${COMP_WORDS[COMP_CWORD-1]} ;;
        words) words=("${COMP_WORDS[@]}") ;;
        cword) cword=$COMP_CWORD ;;
        esac
    done
}
fi
if ! declare -F _filedir >/dev/null 2>&1; then
_filedir() {
    local __gpushm_f
    compopt -o filenames 2>/dev/null
    if [[ $1 == -d ]]; then
        mapfile -t __gpushm_f < <(compgen -d -- "$cur")
    else
        mapfile -t __gpushm_f < <(compgen -f -- "$cur")
    fi
    COMPREPLY+=("${__gpushm_f[@]}")
}
fi

`

// bashCompletion has 'gpushm completion bash' print bashShim before
// cobra's script.
func bashCompletion(root *cobra.Command) {
	root.InitDefaultCompletionCmd()
	for _, c := range root.Commands() {
		if c.Name() != "completion" {
			continue
		}
		for _, sh := range c.Commands() {
			if sh.Name() != "bash" {
				continue
			}
			sh.Long += "\n\nWithout the bash-completion package (Debian: bash-completion), the script\ndefines the two of its functions it needs, in a minimal form."
			sh.Run = nil
			sh.RunE = func(cmd *cobra.Command, args []string) error {
				noDesc, _ := cmd.Flags().GetBool("no-descriptions")
				if _, err := fmt.Fprint(cmd.OutOrStdout(), bashShim); err != nil {
					return err
				}
				return root.GenBashCompletionV2(cmd.OutOrStdout(), !noDesc)
			}
		}
	}
}
