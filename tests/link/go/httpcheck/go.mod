module httpcheck

go 1.19
